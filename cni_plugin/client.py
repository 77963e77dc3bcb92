"""flannelpy-cni: the thin CNI executable. It forwards; the agent decides.

The runtime runs this once per ADD/DEL/CHECK/GC/STATUS. It answers VERSION
itself and forwards everything else, byte for byte (the CNI_* environment and
stdin), to the flannelpy agent over the unix socket named by the network
config's "agentSocket" key (default /run/flannelpy/cni.sock); it prints the
agent's reply and exits with the agent's code. All CNI logic (validation,
results, errors) lives in the agent, which is warm.

If the agent cannot be reached, ADD, CHECK and GC fail with code 11 (try again
later) and STATUS with code 50 (not available); DEL succeeds silently, because
the agent reconciles leftovers when it returns.

Start-up time is the point of this file, so it is self-contained (no package
imports: write_launcher() embeds it, precompiled, in one executable file that
names its interpreter by absolute path and runs it as ``python -I -S``) and
imports only C modules: ``socket`` and ``json`` would pull in enum, selectors
and re, doubling the start-up time (~16 ms against ~8 ms on the measured
machine). forwarder.c is the same program in C and must stay byte-for-byte
equivalent in its output (tests/integration/test_cni_client.py checks both).
"""

import _json
import _socket
import os
import sys

# The framing of cni_plugin/wire.py, repeated here because this file must run alone.
MAGIC = b"FPCNI1\n"
DEFAULT_SOCKET = "/run/flannelpy/cni.sock"
SOCKET_CONFIG_KEY = "agentSocket"
MAX_REQUEST_BYTES = 4 << 20
MAX_REPLY_BYTES = 4 << 20
SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST_VERSION = SUPPORTED_VERSIONS[-1]
UNIX_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path), the terminating NUL included
EINVAL = 22
ENAMETOOLONG = 36
TRY_AGAIN_LATER = 11
NOT_AVAILABLE = 50
INVALID_NETWORK_CONFIG = 7
INTERNAL = 999
TOO_LARGE = (
    "the request (CNI_* environment and network configuration) is larger than 4 MiB; "
    "shorten the network configuration"
)
DETAILS = (
    "the flannelpy agent serves CNI requests on this node; check that it runs and that "
    "agentSocket in the network config names its socket"
)

_quote = _json.encode_basestring_ascii  # what json.dumps uses for str with ensure_ascii


class _ScanContext:
    # The attributes json.JSONDecoder hands to the C scanner, with json.loads' defaults.
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # accepts "NaN", "Infinity", "-Infinity" as json.loads does


def loads(text: str) -> object:
    """json.loads(text) without importing json (which imports re).

    Same grammar and the same failures: leading and trailing JSON whitespace
    only, the C scanner in between. Raises on anything json.loads rejects.
    """
    scan = _json.make_scanner(_ScanContext())  # type: ignore[arg-type]  # duck-typed decoder
    ws = " \t\n\r"
    start = len(text) - len(text.lstrip(ws))
    value, end = scan(text, start)
    if text[end:].strip(ws):
        raise ValueError("extra data after the JSON value")
    return value


def parse_config(stdin: bytes) -> dict:
    """The network config if stdin is a UTF-8 JSON object, else {} (the agent reports why)."""
    try:
        doc = loads(stdin.decode("utf-8"))
    except Exception:  # any failure means "not a usable config"
        return {}
    return doc if isinstance(doc, dict) else {}


def reply_version(config: dict) -> str:
    """The request's cniVersion if it looks like one (digits and dots, ≤ 15), else the latest."""
    value = config.get("cniVersion")
    if isinstance(value, str) and 0 < len(value) <= 15 and not value.strip("0123456789."):
        return value
    return LATEST_VERSION


def socket_path(config: dict) -> str:
    value = config.get(SOCKET_CONFIG_KEY)
    return value if isinstance(value, str) and value else DEFAULT_SOCKET


def version_reply(version: str) -> bytes:
    versions = ", ".join(_quote(v) for v in SUPPORTED_VERSIONS)
    return f'{{"cniVersion": {_quote(version)}, "supportedVersions": [{versions}]}}'.encode()


def error_json(version: str, code: int, msg: str, details: str = DETAILS) -> bytes:
    """spec.CniError(code, msg, details).to_json(version), byte for byte."""
    tail = f', "details": {_quote(details)}' if details else ""
    return (
        f'{{"cniVersion": {_quote(version)}, "code": {code}, "msg": {_quote(msg)}{tail}}}'.encode()
    )


def env_block(environ: dict) -> bytes:
    """The CNI_* variables as wire.py frames them: sorted "K=V" NUL-terminated entries."""
    return b"".join(k + b"=" + v + b"\0" for k, v in sorted(environ.items()) if k[:4] == b"CNI_")


def read_stdin(limit: int) -> bytes | None:
    """All of stdin, or None if it holds more than ``limit`` bytes."""
    chunks = []
    total = 0
    while total <= limit:
        try:
            chunk = os.read(0, min(1 << 16, limit + 1 - total))
        except OSError:  # a closed or unreadable stdin reads as empty
            break
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks) if total <= limit else None


class AgentUnreachable(Exception):
    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.msg = msg


def _strerror(e: OSError) -> str:
    return os.strerror(e.errno) if e.errno else str(e)


def _address(path: str) -> bytes:
    """The socket address for ``path``; OSError with forwarder.c's errno when unusable."""
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \\ud800 escape
        raise OSError(EINVAL, "") from None
    if b"\0" in raw:
        raise OSError(EINVAL, "")
    if len(raw) >= UNIX_PATH_MAX:
        raise OSError(ENAMETOOLONG, "")
    return raw


def forward(path: str, request: bytes) -> tuple[int, bytes]:
    """Send one request to the agent; (exit code, stdout bytes) or AgentUnreachable."""
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.connect(_address(path))
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise AgentUnreachable(
            f"the flannelpy agent is not running: cannot connect to {path} ({_strerror(e)})"
        ) from None
    try:
        return _exchange(sock, request)
    except OSError as e:
        reason = _strerror(e)
    except AgentUnreachable as e:
        reason = e.msg
    finally:
        sock.close()
    raise AgentUnreachable(f"the flannelpy agent did not answer on {path} ({reason})")


def _exchange(sock: _socket.socket, request: bytes) -> tuple[int, bytes]:
    sock.sendall(request)
    sock.shutdown(_socket.SHUT_WR)
    chunks = []
    total = 0
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        total += len(chunk)
        if total > MAX_REPLY_BYTES + 4:
            raise AgentUnreachable("reply larger than 4 MiB")
        chunks.append(chunk)
    reply = b"".join(chunks)
    if len(reply) < 4:
        raise AgentUnreachable("connection closed without a reply")
    code = int.from_bytes(reply[:4], "big")
    return (code if code <= 255 else 1), reply[4:]


def write_stdout(data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(1, view) :]
        except OSError:  # nobody reads our answer; the exit code still tells
            return


def run(environ: dict) -> int:
    """One invocation; returns the exit code after writing stdout."""
    block = env_block(environ)
    header = MAGIC + len(block).to_bytes(4, "big") + block
    limit = MAX_REQUEST_BYTES - len(header)
    stdin = read_stdin(limit) if limit >= 0 else None
    if stdin is None:
        write_stdout(error_json(LATEST_VERSION, INVALID_NETWORK_CONFIG, TOO_LARGE, ""))
        return 1
    config = parse_config(stdin)
    version = reply_version(config)
    command = environ.get(b"CNI_COMMAND", b"")
    if command == b"VERSION":
        write_stdout(version_reply(version))
        return 0
    try:
        code, stdout = forward(socket_path(config), header + stdin)
    except AgentUnreachable as e:
        if command == b"DEL":
            return 0
        status = NOT_AVAILABLE if command == b"STATUS" else TRY_AGAIN_LATER
        write_stdout(error_json(version, status, e.msg))
        return 1
    write_stdout(stdout)
    return code


def main() -> None:
    try:
        code = run(dict(os.environb))
    except Exception as e:  # a CNI plugin answers in JSON, never a traceback
        msg = f"flannelpy-cni failed unexpectedly: {e!r}"
        write_stdout(error_json(LATEST_VERSION, INTERNAL, msg, ""))
        code = 1
    sys.exit(code)


def write_launcher(dest_path: str, python: str = sys.executable) -> None:
    """Install this client as one self-contained executable at ``dest_path``.

    The shebang names ``python`` directly (never /usr/bin/env: ``python3`` on
    PATH may be a shell shim costing ~90 ms) with ``-IS``: isolated mode, no
    site, so nothing from the environment or site-packages slows or changes it.
    Written atomically (temp file + rename), mode 0755.
    """
    if not os.path.isabs(python) or any(c.isspace() for c in python) or len(python) > 120:
        raise ValueError(
            f"interpreter {python!r} cannot go in a shebang line; pass an absolute path "
            "without whitespace, at most 120 characters"
        )
    with open(__file__, encoding="utf-8") as f:
        source = f.read()
    if source.startswith("#!"):
        raise ValueError("write_launcher needs the cni_plugin package's client.py, not a launcher")
    text = launcher_text(python, source, sys.implementation.cache_tag)
    directory = os.path.dirname(os.path.abspath(dest_path))
    tmp = os.path.join(directory, f".{os.path.basename(dest_path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def launcher_text(python: str, source: str, cache_tag: str | None) -> str:
    """The launcher: the client precompiled for the interpreter that wrote it, its source
    for any other. A script is compiled on every run (~2 ms of a ~10 ms start); the
    precompiled code object is used only when the interpreter's bytecode tag matches."""
    import marshal  # only the writer needs it at top level; the launcher imports its own

    code = compile(source, "flannelpy-cni", "exec", optimize=2)
    return (
        f"#!{python} -IS\n"
        "# flannelpy-cni, written by cni_plugin.client.write_launcher.\n"
        "import sys\n"
        f"if sys.implementation.cache_tag == {cache_tag!r}:\n"
        "    import marshal\n"
        f"    exec(marshal.loads({marshal.dumps(code)!r}))\n"
        "else:\n"
        f"    exec(compile({source!r}, 'flannelpy-cni', 'exec'))\n"
    )


if __name__ == "__main__":
    main()
