"""``python -m hicache.sgl_jax <args>``: sgl-jax's HTTP server with hicache (``hicache.sgl_jax.server``)."""

from hicache.sgl_jax.server import main

if __name__ == "__main__":
    main()
