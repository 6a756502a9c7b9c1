"""Sandbox harness: runs one program against its unit tests, streaming JSON records."""

# Not imported by the package: sandbox.py runs this file as
# `python -I harness.py <job.json>` inside the namespaces, so it uses the
# standard library and its sibling confine.py only. It confines itself, then
# forks a child per program run. Expected outputs never enter the sandbox:
# stdin/stdout and function-call verdicts are computed outside from what the
# children print or return. Assert and check() verdicts have to be computed in
# the child, so every name the harness uses after untrusted code has run is
# bound before it runs (a program may replace builtins).

import ast
import builtins
import contextlib
import json
import os
import resource
import select
import signal
import sys
import time
import traceback
import types

if __package__:
    from magic_jax.rewards.confine import confine, kill_others
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from confine import confine, kill_others  # type: ignore[no-redef, import-not-found]

    del sys.path[0]

_BaseException = BaseException
_SystemExit = SystemExit
_type = type
_len = len
_bool = bool
_str = str
_getattr = getattr
_callable = callable
_isinstance = isinstance
_hasattr = hasattr
_sorted = sorted
_enumerate = enumerate
_dict = dict
_exec = exec
_eval = eval
_dumps = json.dumps
_write = os.write
_exit = os._exit
_PRISTINE = dict(builtins.__dict__)
_SCALARS = (int, float, complex, bool, str, bytes, type(None))
_SEQUENCES = (list, tuple, set, frozenset)
_REC_FD = 3


def emit(record, fd=1):
    """Writes one JSON line to the record stream."""
    data = (_dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "replace")
    while data:
        data = data[_write(fd, data) :]


def _tmpfile(workdir, content=b""):
    try:
        fd = os.open(workdir, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:
        path = os.path.join(workdir, f".io-{os.getpid()}-{time.monotonic_ns()}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.unlink(path)
    if content:
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def wait_child(pid, timeout):
    """Waits up to ``timeout`` seconds for ``pid``, then kills it. Returns (status, timed_out)."""
    timed_out = False
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        ready, _, _ = select.select([pidfd], [], [], max(timeout, 0.0))
        os.close(pidfd)
        timed_out = not ready
    else:
        deadline = time.monotonic() + timeout
        while not timed_out:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status, False
            timed_out = time.monotonic() >= deadline
            time.sleep(0.002)
    if timed_out:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1], timed_out


def describe(status, timed_out, err_fd):
    """Maps a wait status to (record status, detail)."""
    if timed_out:
        return "timeout", "wall-clock limit"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return "timeout", "cpu-time limit"
        if sig == signal.SIGXFSZ:
            return "error", "file size limit (output too large)"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return "crash", f"killed by {name}"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return "ok", ""
    size = os.fstat(err_fd).st_size
    tail = os.pread(err_fd, 2000, max(0, size - 2000)).decode("utf-8", "replace").strip()
    last = tail.splitlines()[-1] if tail else ""
    return "error", f"exit status {code}: {last[-300:]}"


def fork_child(body, cpu_s, in_fd, out_fd, err_fd, keep_records):
    """Forks a child that runs ``body()`` with redirected stdio and a CPU limit."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        if keep_records:
            os.dup2(1, _REC_FD)
        os.dup2(in_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.closerange(_REC_FD + 1 if keep_records else 3, 1 << 16)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        sys.argv = ["solution.py"]
        sys.set_int_max_str_digits(0)
        body()
    except _BaseException:
        with contextlib.suppress(_BaseException):
            traceback.print_exc()
    _exit(1)


def _fresh_main():
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = builtins
    module.__dict__["__file__"] = "solution.py"
    # The program sees itself as __main__, not the harness.
    sys.modules["__main__"] = module
    return module.__dict__


def _finish_script(status):
    threading = sys.modules.get("threading")
    if threading is not None:
        main = threading.main_thread()
        for t in threading.enumerate():
            if t is not main and not t.daemon:
                t.join()
    for stream in (sys.stdout, sys.__stdout__, sys.stderr):
        try:
            stream.flush()
        except _BaseException:
            status = 1
    _exit(status)


def run_stdio(job, code, kill_all):
    """One child per test: the program reads the test's stdin; its stdout goes back as a record."""
    lim = job["limits"]
    for i, text in enumerate(job["tests"]):
        in_fd = _tmpfile(".", text.encode("utf-8"))
        out_fd, err_fd = _tmpfile("."), _tmpfile(".")

        def body():
            ns = _fresh_main()
            status = 0
            try:
                exec(code, ns)
            except _SystemExit as e:
                status = 0 if e.code is None or e.code == 0 else 1
                if status and e.code is not None:
                    print(e.code, file=sys.stderr)
            except _BaseException:
                traceback.print_exc()
                status = 1
            _finish_script(status)

        pid = fork_child(body, lim["cpu_s"], in_fd, out_fd, err_fd, keep_records=False)
        status, timed_out = wait_child(pid, lim["test_wall_s"])
        kill_others(kill_all)
        st, detail = describe(status, timed_out, err_fd)
        size = os.fstat(out_fd).st_size
        output = ""
        if size > lim["max_output"]:
            st, detail = "error", f"output of {size} bytes exceeds the limit"
        else:
            output = os.pread(out_fd, size, 0).decode("utf-8", "replace")
        for fd in (in_fd, out_fd, err_fd):
            os.close(fd)
        emit({"i": i, "status": st, "detail": detail, "output": output})
        if st != "ok" and job.get("stop_on_failure", True):
            return


def _plain(x, depth=0, tagged=False):
    """Converts a value to JSON types, refusing anything that could fake equality.

    ``tagged`` keeps tuples and sets apart from lists (observe.normalize does
    the same to the expected side); return values of function-call tests are
    compared like JSON, where a tuple is a list.
    """
    t = _type(x)
    if t is float or t is int or t is str or t is bool or x is None:
        return x
    if depth > 100:
        raise ValueError("value nested too deeply")
    d = depth + 1
    if t is list or (t is tuple and not tagged):
        return [_plain(v, d, tagged) for v in x]
    if t is tuple:
        return {"__tuple__": [_plain(v, d, tagged) for v in x]}
    if t is dict:
        return {_str(_plain(k, d, tagged)): _plain(v, d, tagged) for k, v in x.items()}
    if t is set or t is frozenset:
        items = _sorted(_plain(v, d, tagged) for v in x)
        return {"__set__": items} if tagged else items
    if _getattr(t, "__module__", "") == "numpy" and _callable(_getattr(x, "tolist", None)):
        return _plain(x.tolist(), d, tagged)
    raise TypeError(f"{t.__name__} is not a JSON value")


def _observe(k, value):
    # Reports the value of the left side of `assert call == literal`; the
    # literal itself never entered the sandbox.
    emit({"obs": k, "value": _plain(value, 0, True)}, _REC_FD)


def _is_plain(x, depth=0):
    t = _type(x)
    if t in _SCALARS:
        return True
    if depth > 100:
        return False
    # Plain loops rather than all(): the program may have replaced builtins.all.
    if t in _SEQUENCES:
        for v in x:  # noqa: SIM110
            if not _is_plain(v, depth + 1):
                return False
        return True
    if t is dict:
        for k, v in x.items():  # noqa: SIM110
            if not (_is_plain(k, depth + 1) and _is_plain(v, depth + 1)):
                return False
        return True
    return False


def strict_eq(a, b):
    """``a == b`` that an object overriding ``__eq__`` cannot fake against a plain value."""
    if _getattr(_type(a), "__module__", "") == "numpy" and _callable(_getattr(a, "tolist", None)):
        a = a.tolist()
    plain_a, plain_b = _is_plain(a), _is_plain(b)
    if plain_a and plain_b:
        return _bool(a == b)
    if plain_a or plain_b:
        return False
    return _bool(a == b)


class _StrictAsserts(ast.NodeTransformer):
    """Rewrites ``x == y`` / ``x != y`` inside assert statements to ``strict_eq``."""

    def visit_Assert(self, node):
        node.test = _StrictCompare().visit(node.test)
        return node


class _StrictCompare(ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        if _len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            call = ast.Call(
                func=ast.Name("__mj_eq__", ast.Load()),
                args=[node.left, node.comparators[0]],
                keywords=[],
            )
            new = call if isinstance(node.ops[0], ast.Eq) else ast.UnaryOp(ast.Not(), call)
            return ast.copy_location(new, node)
        return node


def compile_tests(source, name):
    tree = _StrictAsserts().visit(ast.parse(source, name))
    return compile(ast.fix_missing_locations(tree), name, "exec", dont_inherit=True, optimize=0)


def _test_namespace(ns):
    # Tests see the real builtins even when the program replaced them, and
    # not the program's own definitions of builtin names.
    tns = {k: v for k, v in ns.items() if _type(k) is str and k not in _PRISTINE}
    tns["__builtins__"] = _dict(_PRISTINE)
    tns["__name__"] = "__mj_tests__"
    tns["__mj_eq__"] = strict_eq
    tns["__mj_observe__"] = _observe
    return tns


def _record(i, status, detail="", **extra):
    rec = {"i": i, "status": status, "detail": detail}
    rec.update(extra)
    emit(rec, _REC_FD)


def _exc(e):
    try:
        return "".join(traceback.format_exception_only(_type(e), e)).strip()[-400:]
    except _BaseException:
        return _type(e).__name__


def _resolve(ns, name):
    sol = ns.get("Solution")
    if _isinstance(sol, _type) and _hasattr(sol, name):
        return lambda: _getattr(sol(), name)
    fn = ns.get(name)
    if not _callable(fn):
        return None
    code = _getattr(fn, "__code__", None)
    if code is not None and code.co_argcount and code.co_varnames[0] == "self":
        # A method written without its class: wrap it LeetCode style.
        wrapper = _type("Solution", (), {name: fn})
        return lambda: _getattr(wrapper(), name)
    return lambda: fn


def run_in_child(job, code, kill_all):
    """Call, assert and check styles: one child loads the program once and runs every test."""
    lim, style, stop = job["limits"], job["style"], job.get("stop_on_failure", True)
    tests = job["tests"]
    if style == "assert":
        compiled = [compile_tests(src, f"<assert {i}>") for i, src in enumerate(tests)]
    elif style == "check":
        compiled = [compile_tests(job["test_code"], "<test_code>")]

    def body():
        ns = _fresh_main()
        try:
            exec(code, ns)
        except _BaseException as e:
            emit({"event": "load_error", "detail": _exc(e)}, _REC_FD)
            _exit(1)
        if style == "call":
            make = _resolve(ns, job["fn_name"])
            if make is None:
                emit({"event": "load_error", "detail": f"{job['fn_name']} not defined"}, _REC_FD)
                _exit(1)
            for i, args in _enumerate(tests):
                try:
                    fn = make()
                    value = _plain(fn(**args) if _type(args) is dict else fn(*args))
                    _record(i, "ok", value=value)
                except _BaseException as e:
                    _record(i, "error", _exc(e))
                    if stop:
                        break
        elif style == "assert":
            tns = _test_namespace(ns)
            for i, obj in _enumerate(compiled):
                try:
                    _exec(obj, tns)
                except _BaseException as e:
                    _record(i, "error", _exc(e))
                    if stop:
                        break
                    continue
                _record(i, "ok")
        else:
            try:
                tns = _test_namespace(ns)
                _exec(compiled[0], tns)
                check = tns.get("check")
                if not _callable(check):
                    raise NameError("test_code defines no check()")
                check(_eval(job["entry_point"], ns))
            except _BaseException as e:
                _record(0, "error", _exc(e))
            else:
                _record(0, "ok")
        _exit(0)

    in_fd, out_fd, err_fd = _tmpfile("."), _tmpfile("."), _tmpfile(".")
    n = max(1, _len(tests))
    wall = min(lim["test_wall_s"] * (n + 1), lim["total_wall_s"])
    cpu = min(lim["cpu_s"] * (n + 1), int(lim["total_wall_s"]) + 1)
    pid = fork_child(body, cpu, in_fd, out_fd, err_fd, keep_records=True)
    status, timed_out = wait_child(pid, wall)
    kill_others(kill_all)
    st, detail = describe(status, timed_out, err_fd)
    for fd in (in_fd, out_fd, err_fd):
        os.close(fd)
    emit({"event": "child", "status": st, "detail": detail})


def main():
    with open(sys.argv[1], "rb") as f:
        job = json.loads(f.read())
    os.unlink(sys.argv[1])
    info = confine(job)
    emit({"event": "ready", **info})
    kill_all = os.getpid() == 1 or _bool(job.get("kill_all"))
    try:
        code = compile(job["code"], "solution.py", "exec", dont_inherit=True, optimize=0)
    except _BaseException as e:
        emit({"event": "load_error", "detail": _exc(e)})
    else:
        if job["style"] == "stdio":
            run_stdio(job, code, kill_all)
        else:
            run_in_child(job, code, kill_all)
    kill_others(kill_all)
    emit({"event": "done"})


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # any setup failure goes to the launcher
        emit({"event": "fatal", "detail": f"{type(e).__name__}: {e}"})
        os._exit(2)
    os._exit(0)
