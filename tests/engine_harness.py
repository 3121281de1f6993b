"""Drive a real Engine (scheduler thread + backend) from tests without HTTP."""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from backend_driver import TEST_DEVICE, device_under_test

from tierlm.runtime.engine import Engine
from tierlm.runtime.io_struct import GenerateOutput, GenerateRequest
from tierlm.runtime.sampling_params import SamplingParams
from tierlm.runtime.server_args import ServerArgs

_ids = itertools.count()


@dataclass
class Result:
    text: str
    token_ids: list[int]
    last: GenerateOutput
    increments: int


def start_engine(model_path, backend: str = "torch", **kw) -> Engine:
    """An engine on ``backend`` ("torch" | "mlx"), passed as ServerArgs.backend (it wins over TIERLM_BACKEND).
    With TIERLM_TEST_DEVICE set, a torch engine runs on that device (float32 unless ``dtype`` is given, the dtype
    of the references); without it, on the engine's own choice of device, in float32 too (--dtype auto is
    bfloat16 on CUDA and on a CPU with native bf16 matmuls)."""
    kw.setdefault("warmup", False)
    if backend == "torch" and TEST_DEVICE and "device" not in kw:
        kw["device"] = device_under_test()
    if backend == "torch":
        kw.setdefault("dtype", "float32")
    engine = Engine(ServerArgs(model_path=str(model_path), backend=backend, **kw))
    engine.start()
    assert engine.parts.backend.name == backend
    return engine


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, **kw).normalize()


async def _collect(engine: Engine, ids: list[int], params: SamplingParams, stream: bool) -> Result:
    rid = f"t{next(_ids)}"
    text, toks, n, last = "", [], 0, None
    async for out in engine.generate(GenerateRequest(rid=rid, input_ids=list(ids), sampling_params=params,
                                                     stream=stream)):
        text += out.text
        toks += out.token_ids
        n += 1
        last = out
    return Result(text, toks, last, n)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        stream: bool = False) -> list[Result]:
    """Submit all prompts at once (they batch together) and wait for every result."""
    plist = params if isinstance(params, list) else [params] * len(prompts)

    async def main():
        return await asyncio.gather(*[_collect(engine, p, sp, stream) for p, sp in zip(prompts, plist)])

    return asyncio.run(main())


def pool_is_clean(engine: Engine) -> bool:
    acc = engine.parts.cache.accounting()
    device_ok = acc["in_use_pages"] == 0 and acc["free_pages"] + acc["cached_pages"] == acc["total_pages"]
    host_ok = "host_total_pages" not in acc or acc["host_free_pages"] + acc["host_cached_pages"] == acc["host_total_pages"]
    return device_ok and host_ok


def disconnect_after(engine: Engine, ids: list[int], params: SamplingParams, increments: int = 1) -> None:
    """Stream a request and go away after ``increments`` increments, as a client that disconnects."""
    async def main():
        gen = engine.generate(GenerateRequest(rid=f"t{next(_ids)}", input_ids=list(ids), sampling_params=params,
                                              stream=True))
        n = 0
        async for _ in gen:
            n += 1
            if n == increments:
                break
        await gen.aclose()

    asyncio.run(main())


def settles_clean(engine: Engine, timeout: float = 10.0) -> bool:
    """Wait until the scheduler has no work left; True when the pools are then clean (no page leaked)."""
    import time

    deadline = time.time() + timeout
    while not (pool_is_clean(engine) and not engine.parts.scheduler.has_work()) and time.time() < deadline:
        time.sleep(0.01)
    return pool_is_clean(engine) and not engine.parts.scheduler.has_work()
