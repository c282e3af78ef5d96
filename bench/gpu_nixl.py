"""bench/gpu_nixl.py: raw NIXL WRITE bandwidth VRAM->VRAM, one GPU and across two GPUs.

Measures, in one run and for one descriptor of 1 MiB ... 256 MiB:

  torch     baselines: ``dst.copy_(src)`` D2D on cuda:0 and peer copy cuda:0 -> cuda:1
            (CUDA events, and host-timed copy + synchronize, like the NIXL numbers);
  nixl      NIXL/UCX WRITE (READ where a configuration asks) from an initiator agent into a
            target agent: same GPU or GPU0 -> GPU1; both agents in one process, or one agent
            per process (multiprocessing spawn, metadata over a pipe); for several UCX
            configurations (UCX_TLS, ``ucx_error_handling_mode``, CUDA_VISIBLE_DEVICES per
            process, agent created before/after the CUDA context).

Every configuration runs in a fresh subprocess (UCX reads its environment once), with
``UCX_LOG_LEVEL=info`` and ``UCX_PROTO_INFO=y`` (a few configurations at ``debug``, which adds
the reason UCX rejects each transport, e.g. "cuda_ipc/cuda cannot reach ...: same process"; the
default ones also with ``UCX_MODULE_LOG_LEVEL=info`` to show which UCX modules load and why
not); each subprocess's output goes to ``<log-dir>/<config>.log`` and the lines that say which
transports were chosen are copied into the JSON.  Each timed transfer is one post
(``transfer``) polled to DONE (``check_xfer_state``) on the host; GB/s = bytes / median time
(1 GB = 1e9 B), bytes counted once.  Data are checked once per size (checksums of source and
destination).  Findings and the working UCX set-up: docs/gpu.md.

Exits 0 with a message (and a ``{"skipped": ...}`` JSON) when no CUDA GPU is present.
Runs with ``nixl`` (meta package), ``nixl_cu13`` or ``nixl_cu12``.

  python bench/gpu_nixl.py --out /tmp/gpu_nixl.json [--configs a,b] [--sizes-mib 1,4,16,64,256]
  python bench/gpu_nixl.py --list                      # the configurations
  python bench/gpu_nixl.py --cpu-test --out /tmp/t.json  # harness dry run without a GPU (DRAM)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MIB = 1 << 20
DEFAULT_SIZES_MIB = [1, 4, 16, 64, 256]

# --------------------------------------------------------------------------------------
# configurations
# --------------------------------------------------------------------------------------
# procs: 1 = both agents in one process, 2 = one agent per process (target spawned).
# src/dst: physical GPU index of the initiator's buffer / the target's buffer.
# visible: "all" = every process sees every GPU; "own" = CUDA_VISIBLE_DEVICES=<its GPU>.
# env: UCX environment for both processes; params: UCX backend params (create_backend).
# ldfix: "auto" = prepend the directories of CUDA libraries that libuct_cuda.so cannot
#        find (if any; see diag.ld_fix); "no" = leave LD_LIBRARY_PATH as it is.
# agent_first: create the NIXL agent (UCX context + worker) before any CUDA call.
# target_ctx: procs == 1 only: "initiator" = the target agent is created and registers its buffer
#             while the initiator's GPU is current; "own" = while its own GPU (dst) is current.
# loglevel: UCX_LOG_LEVEL for that run.

ERR_NONE = {"ucx_error_handling_mode": "none"}

CONFIGS: list[dict[str, Any]] = [  # most informative first (a deadline cuts the tail)
    # one agent per process, both processes see both GPUs, default UCX
    dict(
        name="p2_g01_default",
        procs=2,
        src=0,
        dst=1,
        ldfix="no",
        ops=["WRITE", "READ"],
        loglevel="debug",
        module_log=True,
    ),
    # the earlier failing set-up: one process, two agents, default UCX
    dict(name="p1_g01_default", procs=1, src=0, dst=1, ldfix="no", loglevel="debug", module_log=True),
    # one process, with UCX's opt-in for cuda_ipc inside one process
    dict(
        name="p1_g01_same_process",
        procs=1,
        src=0,
        dst=1,
        env={"UCX_CUDA_IPC_ENABLE_SAME_PROCESS": "y"},
        loglevel="debug",
    ),
    dict(name="p1_g00_same_process", procs=1, src=0, dst=0, env={"UCX_CUDA_IPC_ENABLE_SAME_PROCESS": "y"}),
    # ... and the target agent created / its buffer registered with GPU1 current
    dict(
        name="p1_g01_same_process_ownctx",
        procs=1,
        src=0,
        dst=1,
        env={"UCX_CUDA_IPC_ENABLE_SAME_PROCESS": "y"},
        target_ctx="own",
        ops=["WRITE", "READ"],
        loglevel="debug",
    ),
    dict(name="p2_g01_tls_cuda_tcp", procs=2, src=0, dst=1, env={"UCX_TLS": "cuda,tcp"}, ops=["WRITE", "READ"]),
    dict(name="p2_g01_errnone", procs=2, src=0, dst=1, params=ERR_NONE),
    dict(name="p2_g01_tls_cuda_sm_errnone", procs=2, src=0, dst=1, env={"UCX_TLS": "cuda,sm"}, params=ERR_NONE),
    dict(name="p2_g00_default", procs=2, src=0, dst=0),
    dict(name="p1_g00_default", procs=1, src=0, dst=0),
    # each process sees only its own GPU
    dict(name="p2_g01_own_visible", procs=2, src=0, dst=1, visible="own"),
    # NIXL agent created before the process has a CUDA context
    dict(name="p2_g01_agent_first", procs=2, src=0, dst=1, agent_first=True),
    dict(name="p1_g01_tls_cuda_tcp", procs=1, src=0, dst=1, env={"UCX_TLS": "cuda,tcp"}),
    dict(name="p2_g01_tls_cudacopy_tcp", procs=2, src=0, dst=1, env={"UCX_TLS": "cuda_copy,tcp"}),
]


def _cfg(c: dict[str, Any]) -> dict[str, Any]:
    d = dict(
        procs=1,
        src=0,
        dst=1,
        visible="all",
        env={},
        params={},
        ldfix="auto",
        agent_first=False,
        target_ctx="initiator",
        ops=["WRITE"],
        loglevel="info",
        module_log=False,
    )
    d.update(c)
    return d


# --------------------------------------------------------------------------------------
# helpers shared by parent and workers
# --------------------------------------------------------------------------------------


def _import_nixl():
    """Return (nixl_agent, nixl_agent_config, module name)."""
    errors = []
    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            m = __import__(mod, fromlist=["nixl_agent", "nixl_agent_config"])
            return m.nixl_agent, m.nixl_agent_config, mod
        except Exception as e:  # ImportError, or a broken meta package
            errors.append(f"{mod}: {type(e).__name__}: {e}")
    raise ImportError("no NIXL Python API found: " + "; ".join(errors))


def _nixl_pkg_dir() -> str | None:
    for mod in ("nixl_cu13", "nixl_cu12"):
        try:
            m = __import__(mod)
            return os.path.dirname(m.__file__)
        except Exception:
            continue
    return None


def _make_agent(name: str, spec: dict[str, Any]):
    nixl_agent, nixl_agent_config, _ = _import_nixl()
    conf = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
    agent = nixl_agent(name, conf)
    agent.create_backend("UCX", dict(spec.get("params") or {}))
    return agent


def _checksum(t, n: int) -> list[int]:
    import torch

    x = t[:n].view(torch.int64)
    return [int(x.sum().item()), int(x[::3].sum().item()), int(x[-1].item())]


def _dev(spec: dict[str, Any], idx: int) -> str:
    return "cpu" if spec.get("cpu_test") else f"cuda:{idx}"


def _sync(spec: dict[str, Any]) -> None:
    if not spec.get("cpu_test"):
        import torch

        torch.cuda.synchronize()


def _set_device(spec: dict[str, Any], idx: int) -> None:
    if not spec.get("cpu_test"):
        import torch

        torch.cuda.set_device(idx)


def _rand(spec: dict[str, Any], idx: int, n: int, seed: int):
    import torch

    g = torch.Generator(device=_dev(spec, idx))
    g.manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=_dev(spec, idx), generator=g)


def _name(x) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


# --------------------------------------------------------------------------------------
# target process (procs == 2)
# --------------------------------------------------------------------------------------


def _target_main(conn, spec: dict[str, Any]) -> None:
    try:
        import torch

        dev = spec["dst_local"]
        max_bytes = spec["max_bytes"]
        agent = None
        if spec.get("agent_first"):
            agent = _make_agent("target", spec)
        _set_device(spec, dev)
        buf = torch.zeros(max_bytes, dtype=torch.uint8, device=_dev(spec, dev))
        _sync(spec)
        if agent is None:
            agent = _make_agent("target", spec)
        agent.register_memory(buf)
        conn.send(("meta", agent.get_agent_metadata(), buf.data_ptr(), dev, os.getpid()))
        n_poll = 0
        while True:
            agent.get_new_notifs()  # progresses the target's UCX worker
            n_poll += 1
            if n_poll & 15 or not conn.poll():
                continue
            msg = conn.recv()
            kind = msg[0]
            if kind == "peer_meta":
                agent.add_remote_agent(msg[1])
                conn.send(("ok",))
            elif kind == "zero":
                buf[: msg[1]].zero_()
                _sync(spec)
                conn.send(("ok",))
            elif kind == "fill":
                buf[: msg[1]].copy_(_rand(spec, dev, msg[1], msg[2]))
                _sync(spec)
                conn.send(("sum", _checksum(buf, msg[1])))
            elif kind == "sum":
                _sync(spec)
                conn.send(("sum", _checksum(buf, msg[1])))
            elif kind == "stop":
                break
        del agent
        conn.send(("bye",))
    except Exception as e:  # report to the initiator instead of dying silently
        import traceback

        traceback.print_exc()
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except Exception:
            pass


# --------------------------------------------------------------------------------------
# initiator (worker process)
# --------------------------------------------------------------------------------------


def _once(agent, h, poll_peer, xfer_timeout_s: float) -> float:
    """Post once and poll to DONE; seconds."""
    t0 = time.perf_counter()
    st = agent.transfer(h)
    while st != "DONE":
        if poll_peer is not None:
            poll_peer()
        st = agent.check_xfer_state(h)
        if st == "ERR":
            raise RuntimeError("transfer state ERR")
        if time.perf_counter() - t0 > xfer_timeout_s:
            raise TimeoutError(f"transfer not DONE after {xfer_timeout_s} s")
    return time.perf_counter() - t0


def _time_xfer(
    agent, h, poll_peer, iters: int, min_iters: int, budget_s: float, warmup: int, xfer_timeout_s: float
) -> dict[str, Any]:
    def once() -> float:
        return _once(agent, h, poll_peer, xfer_timeout_s)

    first = once()
    if first > 0.1:  # a slow path: fewer repetitions
        warmup, min_iters = 1, 2
    for _ in range(max(0, warmup - 1)):
        once()
    times = []
    t_start = time.perf_counter()
    while len(times) < iters and (len(times) < min_iters or time.perf_counter() - t_start < budget_s):
        times.append(once())
    loop_s = time.perf_counter() - t_start
    return dict(
        first_us=first * 1e6,
        median_us=statistics.median(times) * 1e6,
        min_us=min(times) * 1e6,
        max_us=max(times) * 1e6,
        n=len(times),
        loop_s=loop_s,
    )


def _worker_nixl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"pid": os.getpid(), "sizes": []}
    src_dev, dst_dev = spec["src_local"], spec["dst_local"]
    max_bytes = spec["max_bytes"]
    _, _, modname = _import_nixl()
    out["nixl_module"] = modname
    t_setup = time.perf_counter()

    mem = "DRAM" if spec.get("cpu_test") else "VRAM"
    src_id = 0 if spec.get("cpu_test") else src_dev
    dst_id = 0 if spec.get("cpu_test") else dst_dev
    agent = _make_agent("initiator", spec) if spec.get("agent_first") else None
    _set_device(spec, src_dev)
    src = _rand(spec, src_dev, max_bytes, 1234)
    _sync(spec)
    if agent is None:
        agent = _make_agent("initiator", spec)
    agent.register_memory(src)
    try:
        out["backend_params"] = {str(k): str(v) for k, v in dict(agent.get_backend_params("UCX")).items()}
    except Exception as e:
        out["backend_params"] = f"{type(e).__name__}: {e}"

    proc = conn = target = None
    if spec["procs"] == 1:
        if spec.get("target_ctx") == "own" and not spec.get("cpu_test"):
            # the target agent is created and registers its buffer with its own GPU current
            _set_device(spec, dst_dev)
        target = _make_agent("target", spec)
        dst = torch.zeros(max_bytes, dtype=torch.uint8, device=_dev(spec, dst_dev))
        _sync(spec)
        target.register_memory(dst)
        _set_device(spec, src_dev)
        dst_ptr = dst.data_ptr()
        remote = _name(agent.add_remote_agent(target.get_agent_metadata()))
        target.add_remote_agent(agent.get_agent_metadata())

        def poll_peer():
            target.get_new_notifs()

        def zero(n):
            dst[:n].zero_()
            _sync(spec)

        def peer_sum(n):
            _sync(spec)
            return _checksum(dst, n)

        def peer_fill(n, seed):
            dst[:n].copy_(_rand(spec, dst_dev, n, seed))
            _sync(spec)
            return _checksum(dst, n)
    else:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        conn, child = ctx.Pipe()
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if spec["visible"] == "own":
            os.environ["CUDA_VISIBLE_DEVICES"] = str(spec["dst"])
        try:
            proc = ctx.Process(target=_target_main, args=(child, spec), daemon=True)
            proc.start()
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved

        def rpc(*msg, timeout=120.0):
            if msg:
                conn.send(msg)
            if not conn.poll(timeout):
                raise TimeoutError(f"target did not answer {msg[:1]} in {timeout} s")
            r = conn.recv()
            if r[0] == "error":
                raise RuntimeError("target: " + r[1])
            return r

        r = rpc(timeout=180.0)
        _, md, dst_ptr, _tdev, tpid = r
        out["target_pid"] = tpid
        remote = _name(agent.add_remote_agent(md))
        rpc("peer_meta", agent.get_agent_metadata())
        poll_peer = None

        def zero(n):
            rpc("zero", n)

        def peer_sum(n):
            return rpc("sum", n)[1]

        def peer_fill(n, seed):
            return rpc("fill", n, seed)[1]

    out["setup_s"] = time.perf_counter() - t_setup
    try:
        for op in spec["ops"]:
            for n in spec["sizes"]:
                rec: dict[str, Any] = {"op": op, "bytes": n}
                try:
                    local = agent.get_xfer_descs([(src.data_ptr(), n, src_id)], mem)
                    rdesc = agent.get_xfer_descs([(dst_ptr, n, dst_id)], mem)
                    if local is None or rdesc is None:
                        raise RuntimeError("get_xfer_descs returned None")
                    h = agent.initialize_xfer(op, local, rdesc, remote)
                    if op == "WRITE":
                        want = _checksum(src, n)
                        zero(n)
                        _once(agent, h, poll_peer, spec["xfer_timeout_s"])
                        got = peer_sum(n)
                    else:  # READ: target buffer -> initiator buffer
                        want = peer_fill(n, 99 + n)
                        src[:n].zero_()
                        _sync(spec)
                        _once(agent, h, poll_peer, spec["xfer_timeout_s"])
                        _sync(spec)
                        got = _checksum(src, n)
                    rec["data_ok"] = want == got
                    t = _time_xfer(
                        agent,
                        h,
                        poll_peer,
                        spec["iters"],
                        spec["min_iters"],
                        spec["budget_s"],
                        spec["warmup"],
                        spec["xfer_timeout_s"],
                    )
                    rec.update(t)
                    rec["gbps"] = n / (t["median_us"] * 1e-6) / 1e9
                    rec["gbps_best"] = n / (t["min_us"] * 1e-6) / 1e9
                    try:
                        rec["backend"] = agent.query_xfer_backend(h)
                    except Exception:
                        pass
                    agent.release_xfer_handle(h)
                    if op == "READ":  # restore the random source for later WRITEs
                        src.copy_(_rand(spec, src_dev, max_bytes, 1234))
                        _sync(spec)
                except Exception as e:
                    rec["error"] = f"{type(e).__name__}: {e}"
                    out["sizes"].append(rec)
                    print(f"[gpu_nixl] {op} {n}: {rec['error']}", flush=True)
                    if isinstance(e, TimeoutError):
                        raise
                    continue
                out["sizes"].append(rec)
                print(
                    f"[gpu_nixl] {op} {n >> 20:4d} MiB: {rec['gbps']:8.2f} GB/s "
                    f"(median {rec['median_us']:.1f} us, n={rec['n']}, ok={rec['data_ok']})",
                    flush=True,
                )
    finally:
        if conn is not None:
            try:
                conn.send(("stop",))
                if conn.poll(20):
                    conn.recv()
            except Exception:
                pass
        if proc is not None:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
    return out


def _worker_torch(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"rows": []}
    ngpu = torch.cuda.device_count()
    out["device_count"] = ngpu
    out["names"] = [torch.cuda.get_device_name(i) for i in range(ngpu)]
    if ngpu >= 2:
        out["can_access_peer_0_1"] = bool(torch.cuda.can_device_access_peer(0, 1))
        out["can_access_peer_1_0"] = bool(torch.cuda.can_device_access_peer(1, 0))
    max_bytes = spec["max_bytes"]
    src = torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, device="cuda:0")
    cases = [("d2d_gpu0", "cuda:0")]
    if ngpu >= 2:
        cases.append(("peer_0_to_1", "cuda:1"))
    for name, ddev in cases:
        dst = torch.empty(max_bytes, dtype=torch.uint8, device=ddev)
        for n in spec["sizes"]:
            s, d = src[:n], dst[:n]
            for _ in range(3):
                d.copy_(s)
            torch.cuda.synchronize()
            ev = []
            with torch.cuda.device(0):
                for _ in range(spec["torch_iters"]):
                    a = torch.cuda.Event(enable_timing=True)
                    b = torch.cuda.Event(enable_timing=True)
                    a.record()
                    d.copy_(s)
                    b.record()
                    ev.append((a, b))
            torch.cuda.synchronize()
            ev_ms = statistics.median(a.elapsed_time(b) for a, b in ev)
            host = []
            for _ in range(spec["torch_iters"]):
                t0 = time.perf_counter()
                d.copy_(s)
                torch.cuda.synchronize(0)
                if ddev != "cuda:0":
                    torch.cuda.synchronize(1)
                host.append(time.perf_counter() - t0)
            host_s = statistics.median(host)
            ok = (
                bool(torch.equal(d.cpu(), s.cpu()))
                if n <= 16 * MIB
                else bool(torch.equal(d[::4099].cpu(), s[::4099].cpu()))
            )
            row = dict(
                case=name,
                bytes=n,
                event_gbps=n / (ev_ms * 1e-3) / 1e9,
                host_gbps=n / host_s / 1e9,
                event_us=ev_ms * 1e3,
                host_us=host_s * 1e6,
                data_ok=ok,
            )
            out["rows"].append(row)
            print(
                f"[gpu_nixl] torch {name} {n >> 20:4d} MiB: {row['event_gbps']:8.1f} GB/s "
                f"(events), {row['host_gbps']:8.1f} GB/s (host)",
                flush=True,
            )
        del dst
    return out


# --------------------------------------------------------------------------------------
# parent: diagnostics, orchestration, summary
# --------------------------------------------------------------------------------------


def _run(cmd: list[str], timeout: float = 20.0) -> str:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).strip()
    except Exception as e:
        return f"<{cmd[0]}: {type(e).__name__}: {e}>"


def _loaded_libs() -> dict[str, str]:
    """Paths of CUDA libraries mapped into this process (after torch's CUDA init)."""
    found: dict[str, str] = {}
    try:
        for line in open("/proc/self/maps"):
            parts = line.split()
            if len(parts) >= 6 and re.search(r"lib(cuda|nvidia-ml|cudart)\.so", parts[5]):
                found[os.path.basename(parts[5])] = parts[5]
    except OSError:
        pass
    return found


def _collect_diag(torch_mod) -> dict[str, Any]:
    diag: dict[str, Any] = {}
    diag["nvidia_smi_L"] = _run(["nvidia-smi", "-L"])
    diag["nvidia_smi_topo"] = _run(["nvidia-smi", "topo", "-m"])
    diag["nvidia_smi_nvlink"] = _run(["nvidia-smi", "nvlink", "-s"])[:4000]
    diag["ld_library_path"] = os.environ.get("LD_LIBRARY_PATH", "")
    diag["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    ldc = _run(["ldconfig", "-p"])
    diag["ldconfig_cuda"] = [
        ln.strip() for ln in ldc.splitlines() if re.search(r"libcuda\.so|libnvidia-ml|libcudart", ln)
    ]
    try:
        torch_mod.cuda.init()
    except Exception:
        pass
    diag["torch_loaded_libs"] = _loaded_libs()
    pkg = _nixl_pkg_dir()
    diag["nixl_pkg_dir"] = pkg
    missing: dict[str, list[str]] = {}
    if pkg:
        libs = os.path.join(os.path.dirname(pkg), os.path.basename(pkg) + ".libs", "ucx")
        diag["ucx_module_dir"] = libs
        diag["ucx_modules"] = sorted(os.listdir(libs)) if os.path.isdir(libs) else []
        for f in ("libuct_cuda.so.0.0.0", "libucm_cuda.so.0.0.0"):
            p = os.path.join(libs, f)
            if os.path.exists(p):
                out = _run(["ldd", p])
                diag[f"ldd_{f}"] = out
                for ln in out.splitlines():
                    if "not found" in ln:
                        missing.setdefault(ln.split()[0], []).append(f)
    diag["ldd_missing"] = missing
    # directories that would supply what is missing
    fix_dirs: list[str] = []
    if missing:
        cands = [os.path.dirname(p) for p in diag["torch_loaded_libs"].values()]
        tdir = os.path.dirname(torch_mod.__file__)
        cands += [os.path.join(tdir, "lib")]
        sp = os.path.dirname(tdir)
        cands += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib")))
        cands += sorted(glob.glob(os.path.join(sp, "nvidia", "cu*", "lib")))
        cands += [
            "/usr/local/nvidia/lib64",
            "/usr/local/nvidia/lib",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/local/cuda/lib64",
            "/usr/local/cuda/compat",
            "/usr/local/cuda/targets/x86_64-linux/lib",
        ]
        for soname in missing:
            hit = None
            for d in cands:
                if os.path.exists(os.path.join(d, soname)):
                    hit = d
                    break
            if hit is None:
                r = _run(["find", "/", "-xdev", "-maxdepth", "8", "-name", soname], timeout=30)
                for ln in r.splitlines():
                    if ln.startswith("/") and os.path.exists(ln):
                        hit = os.path.dirname(ln)
                        break
            diag.setdefault("ld_fix_found", {})[soname] = hit
            if hit and hit not in fix_dirs:
                fix_dirs.append(hit)
    diag["ld_fix"] = ":".join(fix_dirs)
    return diag


INTERESTING = re.compile(
    r"intra-node cfg|inter-node cfg|lane\[|cuda_ipc|cuda_copy|cudaipc|gdr_copy|same process|"
    r"unreachable|not reachable|cannot reach|no .*transport|dlopen|required module|loaded .*uct_cuda|"
    r"nvlink|NVLink|VRAM|CUDA|cuda|rma_bw|put\b.*zcopy|error|ERROR|WARN|warn|"
    r"Version|\| *(put|get|rndv|am)",
    re.I,
)


def _summarise_log(path: Path, limit: int = 150) -> list[str]:
    """Transport-selection lines of one UCX log: non-table lines matching INTERESTING, and
    the UCX_PROTO_INFO tables for remote memory access (put/get), each folded to one line."""
    keep: list[str] = []
    seen: set[str] = set()
    table: list[str] = []

    def add(key: str) -> None:
        if key not in seen and len(keep) < limit:
            seen.add(key)
            keep.append(key[:600])

    def flush_table() -> None:
        cells = [c.strip(" |") for c in table if c.startswith("|")]
        cells = [c for c in cells if c and not c.startswith("Range")]
        text = " | ".join(re.sub(r"\s*\|\s*", " : ", c) for c in cells)
        if "remote memory" in text:
            add("TABLE " + re.sub(r"\s+", " ", text))
        table.clear()

    try:
        with open(path, errors="replace") as f:
            for line in f:
                body = re.sub(r"^\[[0-9.]+\]\s*\[[^\]]*\]\s*", "", line.strip())
                if body.startswith(("+", "|")):
                    if "cfg#" in body and any("cfg#" in t for t in table):
                        flush_table()  # the next table begins
                    table.append(body)
                    continue
                if table:
                    flush_table()
                if INTERESTING.search(body):
                    add(re.sub(r"0x[0-9a-f]+", "0x", body))
            if table:
                flush_table()
    except OSError:
        pass
    return keep


def _spawn_worker(kind: str, spec: dict[str, Any], env: dict[str, str], log: Path, timeout: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tf:
        res_path = tf.name
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        kind,
        "--worker-spec",
        json.dumps(spec),
        "--worker-out",
        res_path,
    ]
    t0 = time.perf_counter()
    with open(log, "w") as lf:
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the worker's own process group
            except ProcessLookupError:
                pass
            p.wait()
            rc = "timeout"
    wall = time.perf_counter() - t0
    res: dict[str, Any] = {}
    try:
        with open(res_path) as f:
            res = json.load(f)
    except Exception:
        pass
    finally:
        try:
            os.unlink(res_path)
        except OSError:
            pass
    res["rc"] = rc
    res["wall_s"] = wall
    if rc != 0:
        try:
            res["log_tail"] = Path(log).read_text(errors="replace")[-3000:]
        except OSError:
            pass
    return res


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("UCX_") or k.startswith("NIXL_"):
            env.pop(k)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _parent(args) -> int:
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "script": "bench/gpu_nixl.py",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "units": "GB/s = 1e9 bytes / s, bytes counted once; times in microseconds",
    }

    def write():
        tmp = out_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, sort_keys=True))
        tmp.replace(out_path)

    reason = None
    try:
        import torch
    except Exception as e:
        torch = None
        reason = f"torch not importable ({type(e).__name__}: {e})"
    if torch is not None and not torch.cuda.is_available() and not args.cpu_test:
        reason = "no CUDA GPU visible to torch"
    if reason is None:
        try:
            _import_nixl()
        except ImportError as e:
            reason = str(e)
    if reason is not None:
        result["skipped"] = reason
        write()
        print(f"[gpu_nixl] skipped: {reason} (wrote {out_path})")
        return 0

    ngpu = 2 if args.cpu_test else torch.cuda.device_count()
    result["cpu_test"] = bool(args.cpu_test)
    result["torch"] = torch.__version__
    result["device_count"] = ngpu
    _, _, modname = _import_nixl()
    result["nixl_module"] = modname
    try:
        from importlib.metadata import version

        result["nixl_version"] = {p: version(p) for p in ("nixl-cu13", "nixl-cu12", "nixl") if _has_dist(p)}
    except Exception:
        pass
    t_begin = time.perf_counter()
    deadline = t_begin + args.deadline_s
    log_dir = Path(args.log_dir) if args.log_dir else out_path.parent / (out_path.stem + "_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    result["log_dir"] = str(log_dir)
    result["diag"] = {} if args.cpu_test else _collect_diag(torch)
    write()

    sizes = [s * MIB for s in args.sizes_mib]
    common = dict(
        sizes=sizes,
        max_bytes=max(sizes),
        iters=args.iters,
        min_iters=args.min_iters,
        budget_s=args.budget_s,
        warmup=args.warmup,
        xfer_timeout_s=args.xfer_timeout_s,
        torch_iters=args.torch_iters,
        cpu_test=bool(args.cpu_test),
    )

    if not args.skip_torch and not args.cpu_test:
        env = _base_env()
        result["torch_baseline"] = _spawn_worker(
            "torch", common, env, log_dir / "torch.log", timeout=args.config_timeout_s
        )
        write()

    wanted = args.configs.split(",") if args.configs else None
    cfgs = [_cfg(c) for c in CONFIGS if wanted is None or c["name"] in wanted]
    ld_fix = result["diag"].get("ld_fix", "")
    if ld_fix:  # libuct_cuda misses libraries: add "_ldfix" twins of the "no" configs
        twins = []
        for c in cfgs:
            twins.append(c)
            if c["ldfix"] == "no":
                twins.append(dict(c, name=c["name"] + "_ldfix", ldfix="auto", loglevel="info", module_log=True))
        cfgs = twins
    result["configs"] = []
    for c in cfgs:
        if c["procs"] == 1 and c["visible"] == "own" or max(c["src"], c["dst"]) >= ngpu:
            result["configs"].append(dict(name=c["name"], config=c, skipped=f"needs GPU {max(c['src'], c['dst'])}"))
            continue
        if time.perf_counter() > deadline:
            result["configs"].append(dict(name=c["name"], config=c, skipped="deadline"))
            write()
            continue
        env = _base_env()
        env.update({k: str(v) for k, v in c["env"].items()})
        env["UCX_LOG_LEVEL"] = c["loglevel"]
        env["UCX_PROTO_INFO"] = "y"
        if c["module_log"]:
            env["UCX_MODULE_LOG_LEVEL"] = "info"
        if c["ldfix"] == "auto" and ld_fix:
            env["LD_LIBRARY_PATH"] = ld_fix + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        spec = dict(
            common,
            **{k: c[k] for k in ("procs", "src", "dst", "visible", "params", "agent_first", "ops", "target_ctx")},
        )
        if c["visible"] == "own":
            env["CUDA_VISIBLE_DEVICES"] = str(c["src"])
            spec["src_local"], spec["dst_local"] = 0, 0
        else:
            spec["src_local"], spec["dst_local"] = c["src"], c["dst"]
        log = log_dir / f"{c['name']}.log"
        remaining = deadline - time.perf_counter()
        print(
            f"[gpu_nixl] === {c['name']} (procs={c['procs']}, GPU{c['src']}->GPU{c['dst']}, "
            f"env={c['env']}, params={c['params']}, visible={c['visible']}, "
            f"ldfix={'yes' if c['ldfix'] == 'auto' and ld_fix else 'no'})",
            flush=True,
        )
        res = _spawn_worker("nixl", spec, env, log, timeout=max(20.0, min(args.config_timeout_s, remaining + 30)))
        res["name"] = c["name"]
        res["config"] = c
        res["env_set"] = {k: env[k] for k in env if k.startswith("UCX_") or k in ("CUDA_VISIBLE_DEVICES",)}
        if c["ldfix"] == "auto" and ld_fix:
            res["env_set"]["LD_LIBRARY_PATH(prepended)"] = ld_fix
        res["ucx_log_summary"] = _summarise_log(log)
        result["configs"].append(res)
        for r in res.get("sizes", []):
            if "gbps" in r:
                print(
                    f"[gpu_nixl]   {r['op']:5s} {r['bytes'] >> 20:4d} MiB {r['gbps']:8.2f} GB/s ok={r.get('data_ok')}",
                    flush=True,
                )
            else:
                print(f"[gpu_nixl]   {r['op']:5s} {r['bytes'] >> 20:4d} MiB {r.get('error')}", flush=True)
        if res["rc"] != 0:
            print(f"[gpu_nixl]   rc={res['rc']}", flush=True)
        write()

    result["elapsed_s"] = time.perf_counter() - t_begin
    write()
    _print_table(result, sizes)
    print(f"[gpu_nixl] wrote {out_path}; logs in {log_dir}")
    return 0


def _has_dist(name: str) -> bool:
    try:
        from importlib.metadata import version

        version(name)
        return True
    except Exception:
        return False


def _print_table(result: dict[str, Any], sizes: list[int]) -> None:
    hdr = "config".ljust(34) + "".join(f"{s >> 20:>8d}M" for s in sizes)
    print("\nGB/s (median, bytes once)\n" + hdr)
    tb = result.get("torch_baseline", {})
    for case in ("d2d_gpu0", "peer_0_to_1"):
        rows = {r["bytes"]: r for r in tb.get("rows", []) if r["case"] == case}
        if rows:
            print(
                f"torch {case} (events)".ljust(34)
                + "".join(f"{rows[s]['event_gbps']:9.1f}" if s in rows else "        -" for s in sizes)
            )
    for c in result.get("configs", []):
        ops = list(dict.fromkeys(r["op"] for r in c.get("sizes", []))) or ["WRITE"]
        for op in ops:
            rows = {r["bytes"]: r for r in c.get("sizes", []) if r["op"] == op}
            cells = []
            for s in sizes:
                r = rows.get(s)
                if r is None:
                    cells.append("        -")
                elif "gbps" in r:
                    cells.append(f"{r['gbps']:9.2f}" + ("" if r.get("data_ok") else "!"))
                else:
                    cells.append("      err")
            tag = f"{c['name']} {op}" if op != "WRITE" else c["name"]
            extra = (
                f"  ({c['skipped']})"
                if "skipped" in c
                else (f"  rc={c.get('rc')}" if c.get("rc") not in (0, None) else "")
            )
            print(tag.ljust(34) + "".join(cells) + extra)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="bench/results/gpu_nixl.json", help="result JSON path")
    ap.add_argument(
        "--log-dir", default=None, help="per-configuration UCX logs (default: <out stem>_logs beside --out)"
    )
    ap.add_argument(
        "--configs", default=None, help="comma-separated subset of: " + ",".join(c["name"] for c in CONFIGS)
    )
    ap.add_argument("--sizes-mib", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_SIZES_MIB)
    ap.add_argument("--iters", type=int, default=30, help="max timed transfers per size")
    ap.add_argument("--min-iters", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=0.3, help="time per size after min-iters")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--torch-iters", type=int, default=20)
    ap.add_argument("--xfer-timeout-s", type=float, default=20.0)
    ap.add_argument("--config-timeout-s", type=float, default=90.0)
    ap.add_argument(
        "--deadline-s", type=float, default=330.0, help="start no new configuration after this many seconds"
    )
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    ap.add_argument(
        "--cpu-test",
        action="store_true",
        help="dry run of the NIXL harness on CPU (DRAM buffers, UCX env as given; "
        "CUDA-only UCX settings will fail): for testing the script without a GPU",
    )
    ap.add_argument("--worker", choices=["nixl", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--worker-spec", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.list:
        for c in CONFIGS:
            print(json.dumps(_cfg(c)))
        return 0
    if args.worker:
        spec = json.loads(args.worker_spec)
        res: dict[str, Any] = {}
        try:
            res = _worker_nixl(spec) if args.worker == "nixl" else _worker_torch(spec)
        except Exception as e:
            import traceback

            traceback.print_exc()
            res["error"] = f"{type(e).__name__}: {e}"
        with open(args.worker_out, "w") as f:
            json.dump(res, f)
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown (NIXL/UCX/CUDA destructors)
    return _parent(args)


if __name__ == "__main__":
    sys.exit(main())
