import itertools
from collections.abc import Sequence

from tqdm import tqdm

from engine_core import EngineCore
from ipc.client.input_processor import InputProcessor, Prompt, load_tokenizer
from ipc.client.output_processor import OutputProcessor, engine_states
from ipc.config import EngineConfig
from ipc.messages import EngineCoreRequest
from ipc.outputs import RequestOutput
from ipc.sampling_params import SamplingParams
from ipc.tokenizer import Message, TokenizerLike
from splitserve.engine_args import make_engine_config


class LLM:
    """Offline generation: an EngineCore driven in this process.

    With tensor_parallel_size 1 the model runs in this process; otherwise in worker
    processes, exactly as under launch.py. Requests are built by the InputProcessor and
    their outputs folded into RequestOutputs by an OutputProcessor, as in the clients
    (detokenization, stop strings, n or best_of > 1 as child requests).
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        if model is None:
            from models.default import default_model_path

            model = default_model_path()
        self.config = make_engine_config(model=model, **engine_args)
        if self.config.distributed_executor_backend == "ray":
            raise ValueError(
                "LLM starts its workers as processes: for Ray workers start a cluster with "
                "launch.py --distributed-executor-backend ray"
            )
        if self.config.data_parallel_size > 1:
            raise ValueError(
                "LLM drives one EngineCore: for data_parallel_size > 1 start a cluster "
                "(launch.py --data-parallel-size N) and use its HTTP server or a "
                "DataParallelClient"
            )
        self.tokenizer = load_tokenizer(self.config.tokenizer)
        self.input_processor = InputProcessor(self.tokenizer)
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
        requests = [
            self.input_processor.process(prompt, params, str(next(self._ids)))
            for prompt, params in zip(prompts, sampling_params, strict=True)
        ]
        return self._run(requests, use_tqdm)

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
            self.input_processor.chat_token_ids(conv, add_generation_prompt, continue_final_message)
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
        self, requests: list[tuple[EngineCoreRequest, str | None]], use_tqdm: bool
    ) -> list[RequestOutput]:
        """Run the requests (each with its prompt's text) to the end."""
        outputs = OutputProcessor(self.tokenizer)
        handles = [outputs.add_request(request, text) for request, text in requests]
        for handle in handles:
            for state in engine_states(handle):
                self.engine.add_request(state.request)
        with tqdm(total=len(handles), disable=not use_tqdm, desc="Generating") as bar:
            while self.engine.has_unfinished_requests():
                processed = outputs.process_outputs(self.engine.step())
                if processed.reqs_to_abort:
                    self.engine.abort_requests(processed.reqs_to_abort)
                bar.update(len(processed.finished))
                if all(handle.result.finished for handle in handles):
                    # Left: a KV producer's blocks, kept for consumers. One more step tells
                    # the workers of them; later calls step them to their end.
                    if self.engine.has_unfinished_requests():
                        self.engine.step()
                    break
        return [handle.result for handle in handles]


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
