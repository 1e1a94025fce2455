"""Server defaults shared by the CLI and the app (no imports: the CLI loads it at start)."""

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt is ~0.5 MiB of text
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# NOTE: uvicorn (h11) has no limit on the time a client takes to send its headers: a client
# that sends a byte now and then holds a connection for ever (slow loris).
DEFAULT_HEADER_TIMEOUT_S = 30.0  # the request line and headers, from their first byte
DEFAULT_BODY_TIMEOUT_S = 60.0  # the whole body, once the headers are in
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0  # an idle kept-alive connection (uvicorn's default)
