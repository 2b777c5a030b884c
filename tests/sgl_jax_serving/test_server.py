"""``python -m hicache.sgl_jax``: sgl-jax's HTTP server with hicache, in a process (group) of its own.

The server is ready when uvicorn logs that it is running (it logs that after binding the socket); the
test then talks to it over HTTP and stops the process group it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from support.net import free_loopback_port
from support.sgl_jax_env import POOL_TOKENS, SAMPLING, rounds, single_device_env

from hicache.sgl_jax.server import parse_args


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[str]:
    port = free_loopback_port()
    args = [
        sys.executable, "-m", "hicache.sgl_jax", "--hicache-eviction-policy", "lfu",
        "--model-path", str(tiny_model), "--skip-tokenizer-init", "--device", "cpu", "--dtype", "float32",
        "--max-total-tokens", str(POOL_TOKENS), "--mem-fraction-static", "0.05", "--disable-precompile",
        "--skip-server-warmup", "--disable-overlap-schedule", "--random-seed", "0",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "info",
    ]
    with single_device_env():
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=dict(os.environ))
    log = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until the next line or the end of the process
            log.append(line)
            if "Uvicorn running on" in line:
                break
        else:
            pytest.fail(f"server exited with {proc.wait()}:\n{''.join(log[-40:])}")
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the server and the scheduler/detokenizer it spawned
        proc.wait()


def test_http_generate_is_exact_and_the_head_reports_hits(server: str, no_cache_outputs: list[list[int]]) -> None:
    prompts = rounds()[0] + [rounds()[-1][0]]  # round one, then its first prompt again
    outputs = []
    for prompt in prompts:
        res = requests.post(f"{server}/generate", json={"input_ids": prompt, "sampling_params": SAMPLING}, timeout=300)
        res.raise_for_status()
        outputs.append(res.json()["output_ids"])
    assert outputs == no_cache_outputs[:2] + [no_cache_outputs[0]]
    info = requests.get(f"{server}/get_server_info", timeout=60).json()
    stats = info["internal_states"][0]["hicache"]
    assert stats["matched_tokens"] > 0 and stats["request_pages"] == 1


def test_cli_flags_split_between_hicache_and_sgl_jax(tiny_model: Path) -> None:
    options, server_args = parse_args(["--hicache-replica", "r1", "--model-path", str(tiny_model), "--page-size", "4"])
    assert options.replica == "r1" and options.eviction_policy.value == "lru"
    assert server_args.model_path == str(tiny_model) and server_args.page_size == 4
    with pytest.raises(SystemExit):
        parse_args(["--hicache-eviction-policy", "nope", "--model-path", str(tiny_model)])
    options, _ = parse_args(["--hicache-host-pages", "64", "--hicache-l3-url", "file:///tmp/x",
                             "--hicache-write-policy", "write_back", "--model-path", str(tiny_model)])
    assert (options.host_pages, options.l3_url, options.write_policy.value) == (64, "file:///tmp/x", "write_back")
    with pytest.raises(ValueError, match="needs an L2 tier"):
        parse_args(["--hicache-l3-url", "file:///tmp/x", "--model-path", str(tiny_model)])
