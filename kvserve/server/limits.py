"""Server defaults shared by the CLI and the app (no imports: the CLI loads it at start)."""

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt is ~0.5 MiB of text
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
