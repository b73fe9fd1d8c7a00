"""Untrusted side of a sandbox run: load the program, answer calls with plain values.

Runs in its own fresh interpreter as an unprivileged uid, under resource limits and (when
available) in fresh namespaces.  It holds no secret and never sees the test code: the judge
sends only "call f(*args)" requests and decodes the replies into fresh builtin objects.  So
nothing the program does in this process (patching builtins, walking frames, printing fake
results, exiting early) can mark a test as passed; at worst it makes its own calls fail.

The judge forks it (first worker) or starts it as ``python -S -s -B -c BOOTSTRAP codec_src
worker_src args...`` (replacements), so no file of the package has to be reachable from
inside the sandbox.

Protocol (codec frames): first request ``(program, names, remote)``, reply
``("ok", {name: kind})`` or ``("error", message)``; then requests ``(name, args, kwargs)``,
replies ``("ok", value)`` or ``("raise", exception_type_name, message)``.

``remote`` names functions that live in another worker (the helper agent's ``aux``): they
are bound before the program loads to stubs that ask the judge to run them, by sending
``("call", name, args, kwargs)`` in place of a reply and reading the judge's answer
(``("ok", value)`` or ``("raise", name, message)``) before going on.  So the judge sees,
and counts, every call that reaches the other agent's code; nothing in this process can
claim such a call without making it.
"""

from __future__ import annotations

import builtins
import os
import random
import sys
import types

import codec

REQUEST_LIMIT = 64 << 20
MESSAGE_CAP = 300


def main(argv: list[str]) -> None:
    """Entry point of a re-exec'd worker (see ``worker_control.BOOTSTRAP``)."""
    serve(int(argv[0]), int(argv[1]), int(argv[2]), argv[3] == "1")


def serve(req_fd: int, rep_fd: int, output_limit: int, audit: bool) -> None:
    """Load the program sent on ``req_fd``, then answer calls until EOF."""
    sys.argv = ["program"]
    random.seed(0)  # programs that use random get the same results on every run
    frame = codec.read_frame(req_fd, REQUEST_LIMIT)
    if frame is None:
        return
    program, names, remote = codec.decode(frame)
    if audit:
        install_audit_hook(os.getcwd())
    namespace: dict[str, object] = {"__name__": "__sandbox_program__", "__builtins__": builtins}
    for name in remote:
        namespace[name] = _remote_function(name, req_fd, rep_fd)
    try:
        exec(compile(program, "<program>", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - SystemExit at import time is a load error
        _reply(rep_fd, ("error", describe(exc)), output_limit)
        return
    _reply(rep_fd, ("ok", {n: _kind(namespace[n], output_limit) for n in names if n in namespace}),
           output_limit)
    while (frame := codec.read_frame(req_fd, REQUEST_LIMIT)) is not None:
        name, args, kwargs = codec.decode(frame)
        try:
            result = namespace[name](*args, **kwargs)
            payload = codec.encode(("ok", result), output_limit)
        except codec.CodecError as exc:
            payload = _encode_raise("TypeError", f"the program returned a disallowed value: {exc}")
        except BaseException as exc:  # noqa: BLE001 - everything the call does is reported
            payload = _encode_raise(*_split(exc))
        codec.write_frame(rep_fd, payload)


def _remote_function(name: str, req_fd: int, rep_fd: int):
    """A stand-in for a function of another worker: each call is a round trip to the judge.

    Arguments and results are copied as plain values, so the other agent's code never shares
    an object (or a mutation of one) with this program.
    """

    def call(*args: object, **kwargs: object) -> object:
        try:
            request = codec.encode(("call", name, args, kwargs), REQUEST_LIMIT)
        except codec.CodecError as exc:
            raise TypeError(f"cannot pass this value to {name}(): {exc}") from None
        codec.write_frame(rep_fd, request)
        frame = codec.read_frame(req_fd, REQUEST_LIMIT)
        if frame is None:  # the judge is gone
            os._exit(0)
        answer = codec.decode(frame)
        if answer[0] == "ok":
            return answer[1]
        found = getattr(builtins, str(answer[1]), None)
        try:
            error = found(answer[2]) if issubclass(found, Exception) else None
        except Exception:  # noqa: BLE001 - not a class, or a constructor of another signature
            error = None
        raise error or RuntimeError(f"{answer[1]}: {answer[2]}")

    call.__name__ = call.__qualname__ = name
    return call


def _kind(obj: object, limit: int) -> tuple[str, object]:
    """How the judge should expose a program global the test code refers to."""
    if issubclass(type(obj), types.ModuleType):  # type(): no program __class__ property runs
        return ("module", str(obj.__name__))
    if callable(obj):
        return ("call", None)
    try:
        codec.encode(obj, limit)
    except codec.CodecError:
        return ("opaque", None)
    return ("value", obj)


def _reply(fd: int, message: tuple[object, ...], limit: int) -> None:
    codec.write_frame(fd, codec.encode(message, limit))


def _encode_raise(name: str, message: str) -> bytes:
    return codec.encode(("raise", name[:MESSAGE_CAP], message[:MESSAGE_CAP]), 4 * MESSAGE_CAP)


def _split(exc: BaseException) -> tuple[str, str]:
    try:
        name = str(type(exc).__name__)
        message = str(exc)
    except BaseException:  # noqa: BLE001 - a hostile __str__ must not kill the loop
        return "Exception", "<unprintable exception>"
    return name, message.replace(os.getcwd(), ".")


def describe(exc: BaseException) -> str:
    """Short, deterministic text for a load-time exception."""
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg} (line {exc.lineno})"[:MESSAGE_CAP]
    name, message = _split(exc)
    return (f"{name}: {message}" if message else name)[:MESSAGE_CAP]


_BLOCKED_EVENTS = frozenset(
    {
        "os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "os.startfile",
        "os.symlink", "os.link", "signal.pthread_kill", "pty.spawn", "resource.setrlimit",
        "resource.prlimit", "webbrowser.open", "mmap.__new__",
    }
)
_BLOCKED_PREFIXES = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn")
_BLOCKED_MODULES = frozenset(
    {"_ctypes", "ctypes", "_posixsubprocess", "_socket", "socket", "resource", "mmap", "pty"}
)
_PATH_EVENTS = frozenset(
    {
        "os.mkdir", "os.rmdir", "os.remove", "os.rename", "os.chmod", "os.chown", "os.utime",
        "os.truncate", "os.chdir", "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr",
        "shutil.rmtree", "shutil.copyfile", "shutil.copymode", "shutil.copystat", "shutil.move",
        "shutil.chown", "shutil.make_archive", "shutil.unpack_archive",
    }
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def install_audit_hook(workdir: str) -> None:
    """Refuse process creation, signals, sockets, ctypes, reads outside the standard
    library, and writes outside the working directory.  Frame and gc introspection stay
    allowed: this process holds no secret (typing needs sys._getframe).

    Defense in depth only (audit hooks are not a security boundary); the OS-level isolation
    is what actually contains the program.  The hook cannot be removed once added.
    """
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep
    readable = tuple(
        {realpath(p) + sep for p in sys.path if p and os.path.isdir(p)} | {realpath(workdir) + sep}
    )
    writable = (realpath(workdir) + sep,)
    devices = frozenset({"/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"})

    def inside(path: object, prefixes: tuple[str, ...]) -> bool:
        if type(path) is int:
            return True
        if type(path) not in (str, bytes):
            return False
        full = realpath(fsdecode(path))
        return full in devices or (full + sep).startswith(prefixes)

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (type(mode) is str and any(c in mode for c in "wax+")) or (
                type(flags) is int and flags & _WRITE_FLAGS
            )
            allowed = inside(path, writable if writing else readable)
        elif event in ("os.listdir", "os.scandir"):
            allowed = inside(args[0] if args[0] is not None else ".", readable)
        elif event in _PATH_EVENTS:
            allowed = all(inside(a, writable) for a in args[:2] if type(a) in (str, bytes))
        elif event == "import":
            allowed = str(args[0]).split(".")[0] not in _BLOCKED_MODULES
        elif event == "object.__setattr__":
            allowed = args[1] not in ("__code__", "__defaults__", "__kwdefaults__")
        else:
            allowed = event not in _BLOCKED_EVENTS and not event.startswith(_BLOCKED_PREFIXES)
        if not allowed:
            raise PermissionError(f"sandbox: {event} is not allowed")

    sys.addaudithook(hook)


if __name__ == "__main__":
    main(sys.argv[3:])
