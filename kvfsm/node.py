"""Prefill and decode ranks as separate processes over real transports (``kvfsm demo --transport nixl``).

Theory of operation
-------------------
The driver (``run_cluster``) starts a bootstrap service, then one process per rank:
``python -m kvfsm.node --role prefill|decode --rank R --bootstrap ADDR --config JSON``. Each node
builds its endpoint from a ZMQ control plane and a NIXL data plane, registers it with the bootstrap
service, and runs an engine-like loop over the same deterministic room plan: rooms in waves of
``concurrency``, each room on slot ``i`` of its wave, prefill rank ``r`` feeding decode rank ``r``
(equal TP). Before a room starts, prefill fills its pages with bytes derived from (seed, rank,
room) and decode, once the room succeeded, recomputes those bytes and compares every byte of KV
and aux. A wave's pages are reused by the next wave only after every room of the wave concluded
(and no write may still land in them), so a stale or misdirected write shows as a mismatch.

Nodes talk to the driver only through their standard streams: one JSON object per line on stdout
(``ready``, ``chunk``, ``wave``, ``result``), logs on stderr; the driver closes a prefill node's
stdin to let it exit (after every decode node reported), and kills whatever is still alive at its
deadline, counting it as a leak. ``kill_prefill`` kills one prefill process with SIGKILL in the
middle of a wave's transfers: the decode rank it fed must fail those rooms within their timeout,
every other rank must finish, nothing may hang and no process may outlive the run.

Network namespaces (``prefill_netns``/``decode_netns`` with their addresses) put the two sides on
two "hosts" joined by a veth pair; the bootstrap service then runs as a process in the prefill
namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvfsm.protocol import KVPoll
from kvfsm.runtime import DecodeManager, PrefillManager, RuntimeConfig

TERMINAL = (KVPoll.Success, KVPoll.Failed)


@dataclass
class ClusterConfig:
    rooms: int = 32
    chunks: int = 4
    ranks: int = 2
    pages_per_chunk: int = 4
    page_bytes: int = 16384
    aux_bytes: int = 64
    concurrency: int = 8
    seed: int = 0
    transfer_timeout: float = 5.0
    chunk_interval: float = 0.0  # prefill: seconds between a wave's chunk rounds (kill tests)
    ucx_params: dict[str, str] = field(default_factory=dict)  # NIXL UCX backend parameters
    caller_posts: str = "auto"  # NixlDataPlane: who posts writes (auto: the caller for device memory)
    batched: bool = False  # prefill: each chunk round of a wave in one send_many() (an engine's forward step)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for node processes (UCX_TLS...)
    prefill_host: str = "127.0.0.1"
    decode_host: str = "127.0.0.1"
    prefill_netns: str = ""
    decode_netns: str = ""
    deadline_s: float = 120.0

    @property
    def pages_per_room(self) -> int:
        return self.chunks * self.pages_per_chunk

    @property
    def region_pages(self) -> int:
        return self.pages_per_room * self.concurrency

    def runtime(self) -> RuntimeConfig:
        t = self.transfer_timeout
        return RuntimeConfig(
            workers=2,
            timeouts={"transfer": t, "hold": 2 * t, "bootstrap": 4 * t, "input": 4 * t, "fence": 8 * t},
            register_retry_s=0.2,
            early_ttl_s=4 * t,
        )


def waves(cfg: ClusterConfig) -> Iterator[list[int]]:
    """Room ids in waves of ``concurrency``; room ids are sparse on purpose."""
    ids = [1000 + 7 * i for i in range(cfg.rooms)]
    for w in range(0, cfg.rooms, cfg.concurrency):
        yield ids[w : w + cfg.concurrency]


def src_pages(cfg: ClusterConfig, slot: int) -> list[int]:
    base = slot * cfg.pages_per_room
    return list(range(base, base + cfg.pages_per_room))


def dst_pages(cfg: ClusterConfig, slot: int) -> list[int]:
    # a different slot order on decode, so a write to the wrong destination cannot pass unnoticed
    base = (cfg.concurrency - 1 - slot) * cfg.pages_per_room
    return list(range(base, base + cfg.pages_per_room))


def room_bytes(cfg: ClusterConfig, prefill_rank: int, room: int) -> tuple[np.ndarray, np.ndarray]:
    """The KV and aux bytes prefill rank ``prefill_rank`` sends for ``room``."""
    rng = np.random.default_rng([cfg.seed, prefill_rank, room])
    kv = rng.integers(0, 256, cfg.pages_per_room * cfg.page_bytes, dtype=np.uint8)
    aux = rng.integers(0, 256, cfg.aux_bytes, dtype=np.uint8)
    return kv, aux


_events = sys.stdout  # node_main points this at the original stdout and stdout at stderr


def emit(event: str, **fields: Any) -> None:
    _events.write(json.dumps({"event": event, **fields}) + "\n")
    _events.flush()


def _endpoint(cfg: ClusterConfig, side: str, rank: int, bootstrap: str) -> Any:
    from kvfsm.transport.base import SplitEndpoint
    from kvfsm.transport.nixl import NixlConfig, NixlDataPlane
    from kvfsm.transport.zmq import ZmqConfig, ZmqControlPlane

    host = cfg.prefill_host if side == "prefill" else cfg.decode_host
    name = f"{side}-{rank}"
    data = NixlDataPlane(name, config=NixlConfig(backend_params=cfg.ucx_params, caller_posts=cfg.caller_posts))
    control = ZmqControlPlane(
        name,
        bootstrap=bootstrap,
        side=side,
        rank=rank,
        bind=f"tcp://{host}:*",
        config=ZmqConfig(peer_timeout_s=min(3.0, cfg.transfer_timeout / 2), heartbeat_s=0.25),
    )
    return SplitEndpoint(control, data)


def _wait(handles: dict[int, Any], done: Any, deadline: float) -> bool:
    """Poll rooms until ``done(handle)`` holds for all; False at the deadline."""
    while time.monotonic() < deadline:
        if all(done(h) for h in handles.values()):
            return True
        time.sleep(0.0002)
    return False


def run_prefill(cfg: ClusterConfig, rank: int, bootstrap: str) -> dict[str, Any]:
    ep = _endpoint(cfg, "prefill", rank, bootstrap)
    kv = np.zeros(cfg.region_pages * cfg.page_bytes, dtype=np.uint8)
    aux = np.zeros(cfg.concurrency * cfg.aux_bytes, dtype=np.uint8)
    mgr = PrefillManager(
        rank, ep, kv=kv, aux=aux, page_bytes=cfg.page_bytes, aux_slot_bytes=cfg.aux_bytes, config=cfg.runtime()
    )
    emit("ready", side="prefill", rank=rank, pid=os.getpid())
    outcome = {"success": 0, "failed": 0, "stuck": 0}
    ppr, pb = cfg.pages_per_room, cfg.page_bytes
    for w, wave in enumerate(waves(cfg)):
        senders = {}
        for slot, rid in enumerate(wave):
            rkv, raux = room_bytes(cfg, rank, rid)
            kv[slot * ppr * pb : (slot + 1) * ppr * pb] = rkv
            aux[slot * cfg.aux_bytes : (slot + 1) * cfg.aux_bytes] = raux
            senders[rid] = mgr.create_sender(rid)
        for c in range(cfg.chunks):
            last = c == cfg.chunks - 1
            batch = []
            for slot, rid in enumerate(wave):
                s = senders[rid]
                if s.poll() == KVPoll.Failed:
                    continue
                pages = src_pages(cfg, slot)[c * cfg.pages_per_chunk : (c + 1) * cfg.pages_per_chunk]
                batch.append((s, pages, last, slot if last else None))
            if cfg.batched:
                mgr.send_many(batch)
            else:
                for s, pages, is_last, aux_slot in batch:
                    s.send(pages, is_last=is_last, aux_slot=aux_slot)
            emit("chunk", wave=w, chunk=c)
            if cfg.chunk_interval:
                _wait(senders, lambda s: s.poll() in TERMINAL, time.monotonic() + cfg.chunk_interval)
        limit = time.monotonic() + 10 * cfg.transfer_timeout
        if not _wait(senders, lambda s: s.poll() in TERMINAL and not s.pages_in_use(), limit):
            outcome["stuck"] += sum(s.poll() not in TERMINAL or s.pages_in_use() for s in senders.values())
        for s in senders.values():
            code = s.poll()
            if code in TERMINAL and not s.pages_in_use():
                outcome["success" if code == KVPoll.Success else "failed"] += 1
                s.clear()
        emit("wave", wave=w)
    return {"outcome": outcome, "live_rooms": mgr.live_rooms(), "stats": mgr.stats(), "_close": (mgr, ep)}


def run_decode(cfg: ClusterConfig, rank: int, bootstrap: str) -> dict[str, Any]:
    from kvfsm.transport.zmq import BootstrapClient

    ep = _endpoint(cfg, "decode", rank, bootstrap)
    kv = np.zeros(cfg.region_pages * cfg.page_bytes, dtype=np.uint8)
    aux = np.zeros(cfg.concurrency * cfg.aux_bytes, dtype=np.uint8)
    peers = {r: f"prefill-{r}" for r in range(cfg.ranks)}
    client = BootstrapClient(bootstrap)
    client.wait_for([peers[rank]], timeout_s=cfg.deadline_s / 2)
    client.close()
    mgr = DecodeManager(
        rank,
        ep,
        prefill_peers=peers,
        kv=kv,
        aux=aux,
        page_bytes=cfg.page_bytes,
        aux_slot_bytes=cfg.aux_bytes,
        config=cfg.runtime(),
    )
    mgr.connect()
    emit("ready", side="decode", rank=rank, pid=os.getpid())
    outcome = {"success": 0, "failed": 0, "stuck": 0}
    verified = 0
    mismatched: list[int] = []
    concluded_at: list[float] = []
    ppr, pb = cfg.pages_per_room, cfg.page_bytes
    t0 = time.monotonic()
    for w, wave in enumerate(waves(cfg)):
        recv = {rid: mgr.create_receiver(rid) for rid in wave}
        inited: set[int] = set()
        limit = time.monotonic() + 10 * cfg.transfer_timeout
        while time.monotonic() < limit and not all([_decode_step(cfg, wave, recv, inited, rid) for rid in wave]):
            time.sleep(0.0002)
        for slot, rid in enumerate(wave):
            r = recv[rid]
            code = r.poll()
            if code not in TERMINAL or r.pages_fenced():
                outcome["stuck"] += 1
                continue
            if code == KVPoll.Success:
                outcome["success"] += 1
                rkv, raux = room_bytes(cfg, rank, rid)
                base = (cfg.concurrency - 1 - slot) * ppr * pb
                ok = bool((kv[base : base + ppr * pb] == rkv).all())
                ok &= bool((aux[slot * cfg.aux_bytes : (slot + 1) * cfg.aux_bytes] == raux).all())
                verified += rkv.nbytes + raux.nbytes
                if not ok:
                    mismatched.append(rid)
                kv[base : base + ppr * pb] = 0  # a later room must not pass on stale bytes
            else:
                outcome["failed"] += 1
            concluded_at.append(time.time())
            r.clear()
        emit("wave", wave=w, success=outcome["success"], failed=outcome["failed"])
    return {
        "outcome": outcome,
        "bytes_verified": verified,
        "mismatched_rooms": mismatched,
        "seconds": time.monotonic() - t0,
        "last_concluded_at": max(concluded_at, default=0.0),
        "live_rooms": mgr.live_rooms(),
        "stats": mgr.stats(),
        "_close": (mgr, ep),
    }


def _decode_step(cfg: ClusterConfig, wave: list[int], recv: dict[int, Any], inited: set[int], rid: int) -> bool:
    """Announce the room's pages once it waits for them; True once it concluded and is unfenced."""
    r = recv[rid]
    code = r.poll()
    if rid not in inited and code == KVPoll.WaitingForInput:
        slot = wave.index(rid)
        r.init(dst_pages(cfg, slot), slot)
        inited.add(rid)
    return code in TERMINAL and not r.pages_fenced()


def node_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfsm.node")
    p.add_argument("--role", choices=["prefill", "decode", "bootstrap"], required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--bootstrap", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--config", default="{}")
    args = p.parse_args(argv)
    # Our events own stdout; whatever else writes there (NIXL logs to stdout) goes to stderr.
    global _events
    _events = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if args.role == "bootstrap":
        from kvfsm.transport.zmq import BootstrapServer

        server = BootstrapServer(host=args.host)
        emit("ready", side="bootstrap", address=server.address, pid=os.getpid())
        sys.stdin.read()  # until the driver closes our stdin
        server.close()
        return 0
    cfg = ClusterConfig(**json.loads(args.config))
    run = run_prefill if args.role == "prefill" else run_decode
    res = run(cfg, args.rank, args.bootstrap)
    mgr, ep = res.pop("_close")
    emit("result", side=args.role, rank=args.rank, **res)
    if args.role == "prefill":
        sys.stdin.read()  # decode may still be reading our notifications: exit when told
    mgr.close()
    ep.close()
    return 0


# ------------------------------------------------------------------------------------- driver


@dataclass
class _Proc:
    label: str
    popen: subprocess.Popen[str]
    events: queue.Queue[dict[str, Any]]
    stderr: Any
    reader: threading.Thread


def _spawn(cfg: ClusterConfig, label: str, args: list[str], netns: str) -> _Proc:
    cmd = [sys.executable, "-m", "kvfsm.node", *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    err = tempfile.TemporaryFile(mode="w+")
    env = {**os.environ, **cfg.env, "PYTHONUNBUFFERED": "1"}
    popen = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
    )
    events: queue.Queue[dict[str, Any]] = queue.Queue()

    def read() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            try:
                events.put(json.loads(line))
            except json.JSONDecodeError:
                events.put({"event": "garbage", "line": line[:200]})
        events.put({"event": "eof"})

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return _Proc(label, popen, events, err, reader)


def _next(proc: _Proc, deadline: float) -> dict[str, Any] | None:
    try:
        return proc.events.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        return None


def run_cluster(cfg: ClusterConfig, kill_prefill: int | None = None, kill_at_wave: int = 1) -> dict[str, Any]:
    """Run the cluster (see the module docstring); returns a JSON-able result with ``ok``."""
    deadline = time.monotonic() + cfg.deadline_s
    procs: list[_Proc] = []
    boot = _spawn(cfg, "bootstrap", ["--role", "bootstrap", "--host", cfg.prefill_host], cfg.prefill_netns)
    procs.append(boot)
    problems: list[str] = []
    results: dict[str, dict[str, Any]] = {}
    killed_at: float | None = None
    t0 = time.monotonic()
    try:
        ev = _next(boot, deadline)
        if not ev or ev.get("event") != "ready":
            raise RuntimeError(f"bootstrap service did not start: {ev}")
        address = ev["address"]
        conf = json.dumps(asdict(cfg))
        for side, netns in (("prefill", cfg.prefill_netns), ("decode", cfg.decode_netns)):
            for r in range(cfg.ranks):
                args = ["--role", side, "--rank", str(r), "--bootstrap", address, "--config", conf]
                procs.append(_spawn(cfg, f"{side}-{r}", args, netns))
        nodes = {p.label: p for p in procs[1:]}
        waiting = set(nodes)
        while waiting and time.monotonic() < deadline:
            progressed = False
            for label in sorted(waiting):
                proc = nodes[label]
                try:
                    ev = proc.events.get(timeout=0.01)
                except queue.Empty:
                    continue
                progressed = True
                kind = ev.get("event")
                if kind == "result":
                    results[label] = ev
                    waiting.discard(label)
                elif kind == "eof":
                    waiting.discard(label)
                    if label != f"prefill-{kill_prefill}":
                        problems.append(f"{label} exited (status {proc.popen.wait()}) without a result")
                elif (
                    kind == "chunk"
                    and label == f"prefill-{kill_prefill}"
                    and killed_at is None
                    and ev.get("wave") == kill_at_wave
                    and ev.get("chunk") == 0
                ):
                    # the time before the kill: decode may conclude before os.kill returns
                    killed_at = time.time()
                    os.kill(proc.popen.pid, signal.SIGKILL)
                    waiting.discard(label)
                elif kind == "garbage":
                    problems.append(f"{label} printed a non-JSON line: {ev['line']!r}")
            if not progressed:
                time.sleep(0.01)
            if all(lbl in results or not lbl.startswith("decode") for lbl in nodes if lbl.startswith("decode")):
                for lbl, proc in nodes.items():  # every decode reported: prefill may exit
                    if lbl.startswith("prefill") and proc.popen.stdin and not proc.popen.stdin.closed:
                        proc.popen.stdin.close()
        problems += [f"{lbl} did not finish before the deadline" for lbl in sorted(waiting)]
    finally:
        leaked = _reap(procs, deadline)
    seconds = time.monotonic() - t0
    problems += [f"{lbl} had to be killed at the end" for lbl in leaked]
    return _summarise(cfg, results, problems, seconds, kill_prefill, killed_at, procs)


def _reap(procs: list[_Proc], deadline: float) -> list[str]:
    """Let every process exit (closing stdin; the bootstrap service last, as nodes unregister
    when they close), kill what is left; returns the ones killed."""
    leaked = []
    for group in (procs[1:], procs[:1]):
        for p in group:
            if p.popen.stdin and not p.popen.stdin.closed:
                try:
                    p.popen.stdin.close()
                except OSError:
                    pass
        leaked += _wait_group(group, deadline)
    return leaked


def _wait_group(procs: list[_Proc], deadline: float) -> list[str]:
    leaked = []
    for p in procs:
        try:
            p.popen.wait(timeout=max(5.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            leaked.append(p.label)
            os.killpg(p.popen.pid, signal.SIGKILL)
            p.popen.wait()
        p.reader.join(timeout=5)
    return leaked


def _summarise(
    cfg: ClusterConfig,
    results: dict[str, dict[str, Any]],
    problems: list[str],
    seconds: float,
    kill_prefill: int | None,
    killed_at: float | None,
    procs: list[_Proc],
) -> dict[str, Any]:
    decode = {int(k.split("-")[1]): v for k, v in results.items() if k.startswith("decode")}
    prefill = {int(k.split("-")[1]): v for k, v in results.items() if k.startswith("prefill")}
    succeeded = sum(v["outcome"]["success"] for v in decode.values())
    failed = sum(v["outcome"]["failed"] for v in decode.values())
    stuck = sum(v["outcome"]["stuck"] for v in [*decode.values(), *prefill.values()])
    mismatched = sorted(rid for v in decode.values() for rid in v["mismatched_rooms"])
    leftover = sum(v["live_rooms"] for v in [*decode.values(), *prefill.values()])
    verified = sum(v["bytes_verified"] for v in decode.values())
    expect_all = kill_prefill is None
    for r in range(cfg.ranks):
        if r not in decode:
            continue
        o = decode[r]["outcome"]
        if (expect_all or r != kill_prefill) and o["success"] != cfg.rooms:
            problems.append(f"decode rank {r}: {o['success']} of {cfg.rooms} rooms succeeded")
    failure_seconds = None
    if kill_prefill is not None:
        if killed_at is None:
            problems.append(f"prefill rank {kill_prefill} was never killed (it finished too early)")
        elif kill_prefill in decode:
            o = decode[kill_prefill]["outcome"]
            if not o["failed"]:
                problems.append(f"decode rank {kill_prefill}: no room failed after its prefill was killed")
            failure_seconds = decode[kill_prefill]["last_concluded_at"] - killed_at
            if failure_seconds > cfg.transfer_timeout + 2.0:
                problems.append(
                    f"decode rank {kill_prefill} took {failure_seconds:.2f} s after the kill to conclude its rooms "
                    f"(timeout {cfg.transfer_timeout} s)"
                )
    if mismatched:
        problems.append(f"rooms with mismatched bytes: {mismatched[:10]}")
    if stuck:
        problems.append(f"{stuck} rooms did not conclude")
    if leftover:
        problems.append(f"{leftover} rooms left behind after clear")
    stderr_tail = {}
    for p in procs:
        p.stderr.seek(0)
        text = p.stderr.read()
        p.stderr.close()
        if problems:
            stderr_tail[p.label] = text[-2000:]
    moved = sum(v["stats"]["counters"].get("bytes_written", 0) for v in prefill.values())
    return {
        "config": asdict(cfg),
        "transport": "zmq+nixl",
        "processes": len(procs),
        "rooms": cfg.rooms * cfg.ranks,
        "succeeded": succeeded,
        "failed": failed,
        "bytes_verified": verified,
        "mismatched_rooms": mismatched,
        "seconds": seconds,
        "killed_prefill": kill_prefill,
        "seconds_kill_to_decode_concluded": failure_seconds,
        "bytes_written_by_prefill": moved,
        "exit_codes": {p.label: p.popen.returncode for p in procs},
        "problems": problems,
        "stderr_tail": stderr_tail,
        "ok": not problems,
    }


if __name__ == "__main__":
    sys.exit(node_main())
