import itertools
import time
from collections.abc import Sequence

from tqdm import tqdm

from engine_core import EngineCore
from ipc.bad_words import with_bad_words_token_ids
from ipc.client.parallel_sampling import ParentRequest, engine_states, is_parallel
from ipc.client.request_state import (
    Prompt,
    RequestState,
    chat_token_ids,
    load_tokenizer,
    prompt_text,
    prompt_token_ids,
)
from ipc.config import EngineConfig
from ipc.messages import EngineCoreRequest, FinishReason
from ipc.outputs import RequestOutput
from ipc.sampling_params import SamplingParams
from ipc.tokenizer import Message, TokenizerLike


class LLM:
    """Offline generation: an EngineCore driven in this process.

    With tensor_parallel_size 1 the model runs in this process; otherwise in worker
    processes, exactly as under launch.py. Requests are folded into RequestOutputs by
    the same RequestState the clients use (detokenization, stop strings); a request with
    n or best_of > 1 runs as child requests, as the clients run it (parallel_sampling.py).
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        if model is None:
            from models.default import default_model_path

            model = default_model_path()
        self.config = EngineConfig(model=model, **engine_args)
        self.tokenizer = load_tokenizer(self.config.tokenizer)
        self.engine = EngineCore(self.config, _make_executor(self.config))
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams(**self.config.sampling_defaults)
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one, or one per prompt")
        token_ids = [prompt_token_ids(self.tokenizer, p) for p in prompts]
        texts = [prompt_text(p) for p in prompts]
        return self._run(token_ids, sampling_params, use_tqdm, texts)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """`continue_final_message` (with add_generation_prompt=False): the model goes on
        with the final message instead of starting a new one."""
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [
            chat_token_ids(self.tokenizer, conv, add_generation_prompt, continue_final_message)
            for conv in conversations
        ]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out in outputs:  # the rendered conversation, as vLLM reports it
            out.prompt = self.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        return outputs

    def get_tokenizer(self) -> TokenizerLike:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the worker processes, or release the model and its KV cache when it runs
        in this process; the LLM cannot generate afterwards."""
        self.engine.shutdown()

    def _run(
        self,
        token_ids: list[list[int]],
        params: Sequence[SamplingParams],
        use_tqdm: bool,
        texts: list[str | None],
    ) -> list[RequestOutput]:
        params = [with_bad_words_token_ids(sp, self.tokenizer) for sp in params]
        results: list[RequestState | ParentRequest] = []
        states: dict[str, RequestState] = {}  # by the engine's request ids
        for ids, sp, text in zip(token_ids, params, texts, strict=True):
            request = EngineCoreRequest(str(next(self._ids)), ids, sp, time.time())
            kind = ParentRequest if is_parallel(sp) else RequestState
            results.append(kind(request, self.tokenizer, None, text))
            for state in engine_states(results[-1]):
                states[state.request.request_id] = state
                self.engine.add_request(state.request)
        with tqdm(total=len(results), disable=not use_tqdm, desc="Generating") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step().outputs:
                    state = states[out.request_id]
                    if state.result.finished:
                        continue
                    parent = state.parent
                    if parent is None:
                        state.apply(out)
                    else:
                        parent.apply(state, out)
                    if state.result.finished:
                        if state.stopped_by_string:  # the engine goes on
                            self.engine.abort_requests([out.request_id])
                        if parent is not None and out.finish_reason == FinishReason.ERROR:
                            self.engine.abort_requests(parent.live_request_ids())
                        if parent is None or parent.result.finished:
                            bar.update(1)
        return [state.result for state in results]


def _make_executor(config: EngineConfig):
    """tp 1: the model in this process. tp > 1: worker processes started here, as
    launch.py starts them, and stopped with the executor (shutdown, garbage collection
    or interpreter exit; they also die with this process)."""
    if config.tensor_parallel_size == 1:
        from worker.inproc_executor import InProcessExecutor

        return InProcessExecutor(config)
    from engine_core.multiproc_executor import MultiprocExecutor
    from ipc.sockets import new_ipc_address
    from splitserve.cluster import start_workers

    address = new_ipc_address()
    return MultiprocExecutor(config, address, start_workers=lambda: start_workers(config, address))
