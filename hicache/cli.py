"""Command line: ``hicache demo|up|status|bench|down`` (also ``python -m hicache``).

``demo`` runs in-process (no cluster). The others talk to an existing Ray cluster (``--address``,
default: ``RAY_ADDRESS`` or the local one): ``up`` starts a replica from a config file, ``status``
prints tiers/occupancy/hit rates per replica, ``bench`` submits a benchmark as a Ray job and follows
its logs (``--replica R``: a benchmark that serves through the running replica R), ``down`` stops a replica. Errors print one line and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class CliError(Exception):
    """A user-facing problem: printed as one line, exit status 1."""


def _probe(target: str) -> None:
    """Fails fast (2 s) when nothing listens at a host:port address, instead of Ray's long retries."""
    import socket

    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise CliError(f"bad Ray address {target!r}: expected HOST:PORT or 'auto'")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError as exc:
        raise CliError(f"no Ray cluster at {target!r} ({exc.strerror or exc}); "
                       "start one with `ray start --head` or `ray up ray_configs/...`") from None


def _connect_ray(address: str | None) -> None:
    import ray

    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    if target != "auto" and "://" not in target:
        _probe(target)
    try:
        ray.init(address=target, namespace="hicache", logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise CliError(f"no Ray cluster at {target!r} ({str(exc).splitlines()[0]}); "
                       "start one with `ray start --head` or `ray up ray_configs/...`") from None


def replica_names() -> list[str]:
    """The replicas whose head actors live in the connected cluster: asked of that cluster's GCS (the
    state API would ask a dashboard at a fixed address, another cluster's where several run)."""
    import ray.util

    from hicache.cluster.ray_head import NAMESPACE

    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"][len("head-"):] for a in names
                  if a["namespace"] == NAMESPACE and a["name"].startswith("head-"))


def cmd_up(args: argparse.Namespace) -> int:
    from hicache.cluster.ray_head import start_replica
    from hicache.replica_file import load_replica_file

    try:
        config = load_replica_file(args.config)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    _connect_ray(args.address)
    try:
        start_replica(config, timeout_s=args.timeout)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(f"replica {config.replica!r} is up")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from hicache.cluster.errors import HiCacheUnavailableError
    from hicache.cluster.ray_head import stop_replica

    _connect_ray(args.address)
    try:
        stop_replica(args.replica)
    except HiCacheUnavailableError:
        raise CliError(f"unknown replica {args.replica!r}; running: {replica_names() or 'none'}") from None
    print(f"replica {args.replica!r} stopped")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import ray

    from hicache.cluster.ray_client import connect
    from hicache.cluster.ray_head import get_head

    _connect_ray(args.address)
    names = [args.replica] if args.replica else replica_names()
    if args.replica and args.replica not in replica_names():
        raise CliError(f"unknown replica {args.replica!r}; running: {replica_names() or 'none'}")
    rows: list[tuple[str, ...]] = []
    for name in names:
        health = ray.get(get_head(name).health.remote(), timeout=args.timeout)
        try:
            st = connect(name, timeout_s=args.timeout).cache_stats()
        except Exception as exc:  # noqa: BLE001 - a replica that cannot answer still gets its row
            rows.append((name, health.state.value, str(health.num_hosts), "-", "-", "-", "-", "-", str(exc)[:30], "-", "-",
                         "-", "-"))
            continue
        q = max(st.get("queried_tokens", 0), 1)
        l3 = st.get("storage", {}).get("prefetch_pages", 0) * st["page_size"]

        def used(tier: str) -> str:
            cap = st.get(f"{tier}_capacity_tokens")
            return f"{st[f'{tier}_tokens']:,}/{cap:,}" if cap else "-"

        rows.append((name, health.state.value, str(health.num_hosts), used("device"),
                     used("host") if "host_tokens" in st else "-",
                     f"{st.get('device_hit_tokens', 0) / q:.0%}" if "queried_tokens" in st else "-",
                     f"{st.get('host_hit_tokens', 0) / q:.0%}" if "queried_tokens" in st else "-",
                     f"{l3 / q:.0%}" if "queried_tokens" in st else "-", str(st.get("in_flight", 0)), *l3_columns(st),
                     drain_column(st), miss_column(st)))
    print("hicache replicas")
    print(format_table(STATUS_COLUMNS, rows))
    return 0


STATUS_COLUMNS = ("replica", "state", "hosts", "L1 used", "L2 used", "hit L1", "hit L2", "hit L3", "in flight",
                  "L3", "L3 errors", "drain", "misses")


def miss_column(st: dict) -> str:
    """The ``misses`` cell: the served prompt tokens' largest miss reasons, as shares of all of them
    (``hicache.cluster.token_account``); ``-`` before any request finished."""
    from hicache.cluster.token_account import miss_summary

    return miss_summary(st.get("prompt_tokens", {}))


def drain_column(st: dict) -> str:
    """The ``drain`` cell: ``-`` (no preemption notice), else its state, pages stored of those L3
    lacked, and what is left (while it drains) or did not fit (``hicache.cluster.drain``)."""
    d = st.get("drain")
    if d is None:
        return "-"
    if d["state"] == "draining":
        return f"draining {d['drained_pages']}/{d['candidate_pages']}p, {d['left_pages']}p left"
    oversized = f" ({d['oversized_pages']}p oversized)" if d.get("oversized_pages") else ""
    return f"{d['state']} {d['drained_pages']}/{d['candidate_pages']}p, {d['not_fitted_pages']}p not fitted{oversized}"


def l3_columns(st: dict) -> tuple[str, str]:
    """The ``L3`` and ``L3 errors`` cells of a replica's ``cache_stats()``: its hosts' breaker state
    (``closed``: L3 answers; ``open``: requests do not ask it) and its errors by kind, nonzero ones
    only (``-``: no L3 attached)."""
    if "storage" not in st:
        return "-", "-"
    errors = [f"{kind}={n}" for kind, n in st.get("storage_errors", {}).items() if n]
    return st.get("storage_breaker", "closed"), " ".join(errors) or "0"


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain right-aligned columns (the core needs no table library: ``rich`` is the demo's extra)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(line, widths)) for line in (header, *rows))


# What a benchmark job ships: the repo root minus all but benchmarks/ (the same list as
# ray_configs/runtime_env/*.yaml; "!." because Ray matches the root itself too). Entrypoints run as
# `python benchmarks/NAME.py` and import their helpers as `benchmarks.X`; hicache is the installed copy.
BENCH_EXCLUDES = ("/*", "!.", "!/benchmarks", "__pycache__", "*.json")


def _serves_a_replica(script: Path) -> bool:
    """Benchmarks that drive a running replica take ``--replica`` (``hicache bench NAME --replica R``)."""
    return '"--replica"' in script.read_text()


def cmd_bench(args: argparse.Namespace) -> int:
    import time

    from ray.job_submission import JobStatus, JobSubmissionClient

    repo = Path(__file__).resolve().parents[1]
    bench_dir = repo / "benchmarks"
    script = bench_dir / f"{args.name}.py"
    if not args.name.isidentifier() or not script.is_file():
        known = sorted(p.stem for p in bench_dir.glob("*.py"))
        raise CliError(f"unknown benchmark {args.name!r}; choose one of {known}")
    bench_args = list(args.bench_args)
    if args.replica is not None:
        if not _serves_a_replica(script):
            serving = sorted(p.stem for p in bench_dir.glob("*.py") if _serves_a_replica(p))
            raise CliError(f"benchmark {args.name!r} does not drive a running replica; these do: {serving}")
        bench_args += ["--replica", args.replica]
    address = args.dashboard or os.environ.get("RAY_DASHBOARD_ADDRESS") or "http://127.0.0.1:8265"
    try:
        client = JobSubmissionClient(address)
    except Exception as exc:  # noqa: BLE001 - connection problems of any kind
        raise CliError(f"no Ray job server at {address!r} ({str(exc).splitlines()[0]})") from None
    entry = shlex.join(["python", f"benchmarks/{script.name}", *bench_args])
    env = {"env_vars": {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}}
    runtime_env = {"working_dir": str(repo), "excludes": list(BENCH_EXCLUDES), **env}
    deadline = time.monotonic() + args.timeout
    job, status = _run_job(client, entry, runtime_env, deadline)
    if status != JobStatus.SUCCEEDED:
        message = (client.get_job_info(job).message or "").splitlines()
        if message:
            print(f"job {job}: {message[0]}")
    return 0 if status == JobStatus.SUCCEEDED else 1


def _run_job(client: Any, entry: str, runtime_env: dict[str, Any], deadline: float) -> tuple[str, Any]:
    """Submits ``entry`` and prints its logs as they come until it ends (or ``deadline``: stopped)."""
    import time

    from ray.job_submission import JobStatus

    while True:
        try:
            job = client.submit_job(entrypoint=entry, runtime_env=runtime_env)
            break
        except RuntimeError as exc:  # the job server answers before the head node's job agent is up
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise CliError(f"submitting the job failed: {str(exc).splitlines()[0]}") from None
            time.sleep(2.0)  # Ray's own advice ("try again later"), bounded by the deadline
    print(f"submitted {job}: {entry}")
    printed = 0
    while True:
        logs = client.get_job_logs(job)
        sys.stdout.write(logs[printed:])
        sys.stdout.flush()
        printed = len(logs)
        status = client.get_job_status(job)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            break
        if time.monotonic() > deadline:
            client.stop_job(job)
            raise CliError(f"job {job} did not finish within the timeout; stopped")
        time.sleep(1.0)
    print(f"job {job}: {status.value}")
    return job, status


DEMO_MODULES = ("rich", "matplotlib")  # the [demo] extra (pyproject.toml)


def main(argv: Sequence[str] | None = None) -> int:
    # Before Ray is imported anywhere: keep Ray on the addresses it is given (loopback in tests).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="multi-turn chat through L1/L2/L3 with the reference engine (embedded)")
    demo.add_argument("--conversations", type=int, default=16)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--output-tokens", type=int, default=8)
    demo.add_argument("--l3-dir", default=".hicache/l3", help="local directory used as L3 (file://)")
    demo.add_argument("--keep-l3", action="store_true", help="reuse what an earlier run left in --l3-dir")
    demo.add_argument("--plot", default="hicache-demo.png")
    demo.add_argument("--seed", type=int, default=0)
    for name, helptext in (("up", "start a replica on an existing Ray cluster"), ("status", "tiers per replica"),
                           ("down", "stop a replica")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or the local cluster)")
        p.add_argument("--timeout", type=float, default=180.0 if name == "up" else 30.0)
        if name == "up":
            p.add_argument("--config", required=True, help="replica config file (YAML or JSON)")
        elif name == "down":
            p.add_argument("--replica", required=True)
        else:
            p.add_argument("--replica", help="only this replica")
    bench = sub.add_parser("bench", help="submit benchmarks/NAME.py as a Ray job and follow its logs; "
                                         "arguments after `--` go to the benchmark")
    bench.add_argument("name", help="benchmark file name without .py, e.g. tree_bench")
    bench.add_argument("--dashboard", help="Ray dashboard / job server URL (default http://127.0.0.1:8265)")
    bench.add_argument("--timeout", type=float, default=3600.0)
    bench.add_argument("--replica", help="serve the benchmark's workload through this running replica "
                                         "(benchmarks that take --replica, e.g. replica_chat)")
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # everything after `--` belongs to the benchmark (`hicache bench NAME -- ...`)
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1 :]
    args = parser.parse_args(argv)
    args.bench_args = passthrough
    handlers = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "bench": cmd_bench}
    if args.command == "demo":
        import importlib.util

        missing = [m for m in DEMO_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            print(f"hicache demo: error: {', '.join(missing)} missing: install the demo extra "
                  "(pip install -e \".[demo]\")", file=sys.stderr)
            return 1
        from hicache.demo import run_demo

        return run_demo(args)
    try:
        return handlers[args.command](args)
    except CliError as exc:
        print(f"hicache {args.command}: error: {exc}", file=sys.stderr)
        return 1
