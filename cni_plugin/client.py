"""flannelpy-cni: the thin CNI executable. It forwards; the agent decides.

The runtime runs this once per ADD/DEL/CHECK/GC/STATUS. It answers VERSION
itself and forwards everything else, byte for byte (the CNI_* environment and
stdin), to the flannelpy agent over the unix socket named by the network
config's "agentSocket" key (default /run/flannelpy/cni.sock); it prints the
agent's reply and exits with the agent's code. All CNI logic (validation,
results, errors) lives in the agent, which is warm.

For ADD, CHECK and DEL it also opens CNI_NETNS itself and passes the open
descriptor with the request (SCM_RIGHTS, see wire.py): the path is the
runtime's and may mean nothing in the agent's mount namespace. A path it cannot
open sends no descriptor; the agent then decides (DEL still succeeds).

Stdin that is not a JSON object fails here with code 6 (failed to decode
content), as libcni's skel answers it: without a config there is no agentSocket
to ask. If the agent cannot be reached or does not answer within the deadline
(DEADLINE_SECONDS), ADD, CHECK and GC fail with code 11 (try again later) and
STATUS with code 50 (not available); DEL succeeds silently, because the agent
reconciles leftovers when it returns.

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
import time

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
DECODE_FAILURE = 6
INVALID_NETWORK_CONFIG = 7
INTERNAL = 999
NETNS_COMMANDS = (b"ADD", b"CHECK", b"DEL")  # the commands that name a pod namespace
# The whole exchange (connect, send, the agent's work, the reply), in seconds. ADD may
# wait up to 300 s for an address (ipWaitSeconds, capped at 300 by the agent) and then
# plumbs the pod; 30 s more covers that on a busy node. The rest is kernel work and
# a per-pod lock (an ADD of the same pod may be ahead), well under a minute.
ADD_DEADLINE_SECONDS = 330
DEADLINE_SECONDS = 60
EAGAIN = 11  # what connect/send/recv answer when SO_SNDTIMEO/SO_RCVTIMEO expire
# struct timeval is two C longs; packed by hand, since _struct costs ~0.5 ms to load.
LONG_BYTES = 8 if sys.maxsize > 2**32 else 4
NOT_AN_OBJECT = (
    "the network configuration on stdin is not a JSON object in UTF-8; pass the network "
    "config as a JSON object"
)
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


MAX_DEPTH = 512  # forwarder.c's nesting limit, applied here too so both refuse alike


def parse_config(stdin: bytes) -> dict | None:
    """The network config if stdin is a UTF-8 JSON object nested at most MAX_DEPTH
    deep, else None."""
    try:
        doc = loads(stdin.decode("utf-8"))
    except Exception:  # any failure means "not a usable config"
        return None
    if not isinstance(doc, dict):
        return None
    # Counting brackets is cheap and bounds the depth; only a config with many
    # brackets is walked.
    if stdin.count(b"[") + stdin.count(b"{") > MAX_DEPTH and _depth(doc) > MAX_DEPTH:
        return None
    return doc


def _depth(doc: object) -> int:
    """The depth of the deepest value (the top level is 0), as forwarder.c counts it."""
    deepest = 0
    stack = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return deepest


def reply_version(config: dict | None) -> str:
    """The request's cniVersion if it looks like one (digits and dots, ≤ 15), else the latest."""
    value = config.get("cniVersion") if config is not None else None
    if isinstance(value, str) and 0 < len(value) <= 15 and not value.strip("0123456789."):
        return value
    return LATEST_VERSION


def socket_path(config: dict | None) -> str:
    if config is None:
        return DEFAULT_SOCKET
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


def forward(
    path: str,
    request: bytes,
    netns_fd: int | None = None,
    timeout: float = DEADLINE_SECONDS,
) -> tuple[int, bytes]:
    """Send one request (and ``netns_fd``, if any) to the agent and wait at most
    ``timeout`` seconds in all; (exit code, stdout bytes) or AgentUnreachable."""
    deadline = time.monotonic() + timeout
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
        try:
            address = _address(path)
            # Blocking, bounded by SO_SNDTIMEO: a full backlog (a burst of pods) waits
            # for room, where a non-blocking connect would fail at once with EAGAIN.
            _arm(sock, _socket.SO_SNDTIMEO, deadline)
            sock.connect(address)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        raise AgentUnreachable(
            f"the flannelpy agent is not running: cannot connect to {path} ({_why(e, timeout)})"
        ) from None
    try:
        return _exchange(sock, request, netns_fd, deadline)
    except OSError as e:
        reason = _why(e, timeout)
    except AgentUnreachable as e:
        reason = e.msg
    finally:
        sock.close()
    raise AgentUnreachable(f"the flannelpy agent did not answer on {path} ({reason})")


def _why(e: OSError, timeout: float) -> str:
    if e.errno == EAGAIN:  # a SO_*TIMEO ran out: the deadline
        return f"timed out after {timeout:g} s"
    return _strerror(e)


def _arm(sock: _socket.socket, option: int, deadline: float) -> None:
    """Bound the next blocking call by what is left of ``deadline``."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise OSError(EAGAIN, "")
    seconds = int(left)
    micros = max(int((left - seconds) * 1e6), 1 if seconds == 0 else 0)  # 0 is "forever"
    order = sys.byteorder
    timeval = seconds.to_bytes(LONG_BYTES, order) + micros.to_bytes(LONG_BYTES, order)
    sock.setsockopt(_socket.SOL_SOCKET, option, timeval)


def _exchange(
    sock: _socket.socket, request: bytes, netns_fd: int | None, deadline: float
) -> tuple[int, bytes]:
    view = memoryview(request)
    if netns_fd is not None:  # with the first bytes, as the framing says
        _arm(sock, _socket.SO_SNDTIMEO, deadline)
        rights = [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, netns_fd.to_bytes(4, sys.byteorder))]
        view = view[sock.sendmsg([view], rights) :]
    while view:
        _arm(sock, _socket.SO_SNDTIMEO, deadline)
        view = view[sock.send(view) :]
    sock.shutdown(_socket.SHUT_WR)
    chunks = []
    total = 0
    while True:
        _arm(sock, _socket.SO_RCVTIMEO, deadline)
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


def open_netns(path: bytes) -> int | None:
    """CNI_NETNS opened here, in the runtime's mount namespace; None if it cannot be
    (the agent then reports it, or for DEL cleans up without it). Closed at exit."""
    if not path:
        return None
    try:
        # O_NONBLOCK: a FIFO named by mistake must not hang the runtime (no effect on nsfs).
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None


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
    if config is None:
        write_stdout(error_json(version, DECODE_FAILURE, NOT_AN_OBJECT, ""))
        return 1
    netns_fd = open_netns(environ.get(b"CNI_NETNS", b"")) if command in NETNS_COMMANDS else None
    timeout = ADD_DEADLINE_SECONDS if command == b"ADD" else DEADLINE_SECONDS
    try:
        code, stdout = forward(socket_path(config), header + stdin, netns_fd, timeout)
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
