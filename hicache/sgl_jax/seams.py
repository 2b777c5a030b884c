"""The sgl-jax seams ``hicache.sgl_jax`` injects through, checked once before anything is launched.

sgl-jax has no plugin registry, so this integration relies on names in its modules (checked against
sgl-jax commit cddbf6f). ``require()`` imports them and raises one ``SglJaxSeamError`` naming the
installed sgl-jax version and every seam that is missing, instead of a failure deep inside the
scheduler subprocess (which sgl-jax answers by killing its parent process). Runs in the process that
builds the Engine and again in the scheduler subprocess.
"""

from __future__ import annotations

import importlib
import inspect

CHECKED_COMMIT = "cddbf6f"  # the sgl-jax commit these seams were read from (../shared/vendor/)

# module -> attributes (dotted: a class attribute) this integration uses.
SEAMS: dict[str, tuple[str, ...]] = {
    # The Engine starts its scheduler through this module global: our launcher swaps it for the
    # duration of one Engine's start.
    "sgl_jax.srt.entrypoints.engine": ("Engine", "run_scheduler_process", "_launch_subprocesses"),
    # In the scheduler subprocess: its class and the tree-cache builder it calls, both module globals.
    "sgl_jax.srt.managers.scheduler": (
        "Scheduler",
        "Scheduler.init_memory_pool_and_cache",
        "Scheduler.get_internal_state",
        "Scheduler.get_new_batch_prefill",
        "run_scheduler_process",
        "build_kv_cache",
    ),
    "sgl_jax.srt.mem_cache.kv_cache_builder": ("build_kv_cache",),
    "sgl_jax.srt.mem_cache.base_prefix_cache": (
        "BasePrefixCache",
        "MatchResult",
        "EvictResult",
        "IncLockRefResult",
    ),
    "sgl_jax.srt.mem_cache.allocator": ("BaseTokenToKVPoolAllocator",),
    # The host tier wraps its layer arrays (``kv_buffer``, handed back through ``replace_buffer``).
    "sgl_jax.srt.mem_cache.memory_pool": ("MHATokenToKVPool", "MHATokenToKVPool.replace_buffer"),
    # The scheduler's HiCache hooks it calls on a tree cache whose ``hicache_enabled`` is True.
    "sgl_jax.srt.managers.schedule_policy": ("PrefillAdder.add_one_req",),
    "sgl_jax.srt.server_args": ("ServerArgs", "ServerArgs.from_cli"),
}
# Only the HTTP server needs these (``hicache.sgl_jax.server``): its module imports the web stack.
HTTP_SEAMS: dict[str, tuple[str, ...]] = {"sgl_jax.srt.entrypoints.http_server": ("launch",)}
# Keyword arguments of ``build_kv_cache`` that our builder reads.
BUILDER_KWARGS = ("server_args", "req_to_token_pool", "token_to_kv_pool_allocator", "page_size", "tp_size")


class SglJaxSeamError(RuntimeError):
    """The installed sgl-jax lacks a seam this integration injects through (another sgl-jax version)."""


def sgl_jax_version() -> str:
    """The installed sgl-jax's version (its package metadata, else ``sgl_jax.__version__``)."""
    from importlib import metadata

    try:
        return metadata.version("sglang-jax")
    except metadata.PackageNotFoundError:
        import sgl_jax

        return str(getattr(sgl_jax, "__version__", "unknown"))


def missing_seams(http: bool = False) -> list[str]:
    """The seams (``module:attribute``) the installed sgl-jax lacks (``http``: the HTTP server's too); empty
    when all are there."""
    missing = []
    for module_name, attributes in {**SEAMS, **(HTTP_SEAMS if http else {})}.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            missing.append(f"{module_name} ({type(e).__name__}: {e})")
            continue
        for dotted in attributes:
            target: object = module
            for part in dotted.split("."):
                target = getattr(target, part, None)
                if target is None:
                    missing.append(f"{module_name}:{dotted}")
                    break
    if not missing:
        from sgl_jax.srt.mem_cache.kv_cache_builder import build_kv_cache

        params = inspect.signature(build_kv_cache).parameters
        missing += [f"sgl_jax.srt.mem_cache.kv_cache_builder:build_kv_cache({name}=)"
                    for name in BUILDER_KWARGS if name not in params]
    return missing


def require(http: bool = False) -> str:
    """Checks every seam (``http``: the HTTP server's too); returns the sgl-jax version, or raises ``SglJaxSeamError`` naming the missing ones
    (``ImportError`` when sgl-jax is not installed at all)."""
    try:
        import sgl_jax  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "hicache.sgl_jax needs sgl-jax: install it from its repository "
            "(pip install -e 'sglang-jax/python[cpu]' or '[tpu]'), see the README"
        ) from e
    version = sgl_jax_version()
    missing = missing_seams(http)
    if missing:
        raise SglJaxSeamError(
            f"sgl-jax {version} lacks the seam(s) hicache.sgl_jax injects through: {', '.join(missing)} "
            f"(this integration was written against sgl-jax commit {CHECKED_COMMIT})"
        )
    return version
