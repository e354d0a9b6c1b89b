import itertools
import time
from collections.abc import Sequence

from tqdm import tqdm
from transformers import AutoTokenizer

from engine_core import EngineConfig, EngineCore
from ipc.defaults import default_sampling_params
from ipc.detokenizer import IncrementalDetokenizer
from ipc.messages import EngineCoreOutput, EngineCoreRequest, SamplingParams
from ipc.outputs import CompletionOutput, RequestOutput

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """Offline generation: an EngineCore driven in this process.

    With tensor_parallel_size 1 the model runs in this process; otherwise in worker
    processes, exactly as under launch.py.
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        if model is None:
            from models.default import default_model_path

            model = default_model_path()
        self.config = EngineConfig(model=model, **engine_args)
        self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer)
        self.engine = EngineCore(self.config, _make_executor(self.config))
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = default_sampling_params(self.config.model)
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one, or one per prompt")
        token_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_ids, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        conversations = [messages] if isinstance(messages[0], dict) else messages
        template = self.tokenizer.apply_chat_template
        prompts = [
            self.tokenizer.encode(
                template(conv, add_generation_prompt=True, tokenize=False), add_special_tokens=False
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(
        self, token_ids: list[list[int]], params: Sequence[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        detokenizers: dict[str, IncrementalDetokenizer] = {}
        for ids, sp in zip(token_ids, params, strict=True):
            request_id = str(next(self._ids))
            results[request_id] = RequestOutput(request_id, ids, [CompletionOutput(0, "", [])])
            detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, ids, sp.skip_special_tokens, sp.stop
            )
            self.engine.add_request(EngineCoreRequest(request_id, ids, sp, time.time()))
        with tqdm(total=len(results), disable=not use_tqdm, desc="Generating") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step().outputs:
                    if self._apply(results[out.request_id], detokenizers[out.request_id], out):
                        bar.update(1)
        return list(results.values())

    def _apply(
        self, result: RequestOutput, detok: IncrementalDetokenizer, out: EngineCoreOutput
    ) -> bool:
        """Fold one engine output into the request's result; True once it finished."""
        if result.finished:
            return False
        completion = result.outputs[0]
        completion.token_ids.extend(out.new_token_ids)
        if out.logprobs:
            completion.logprobs = (completion.logprobs or []) + out.logprobs
        completion.text += detok.add_tokens(out.new_token_ids)
        result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
        finish_reason = out.finish_reason
        if detok.stopped and finish_reason is None:
            self.engine.abort_requests([result.request_id])
            finish_reason = "stop"
        if finish_reason is None:
            return False
        completion.finish_reason = finish_reason
        result.error = out.error
        result.finished = True
        return True


def _make_executor(config: EngineConfig):
    from splitserve.executor import InProcessExecutor

    return InProcessExecutor(config)
