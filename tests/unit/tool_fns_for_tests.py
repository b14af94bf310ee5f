"""Custom tools for the custom tool tests (tests/unit/test_tool_custom.py).

They live in an importable module, not in the test file, because tool workers are fresh
interpreters that import a tool by its "module:function" spec.
"""

import os
import time


def shout(argument: str) -> str:
    """The argument upper-cased, with the worker's pid: an answer the test can check."""
    return f"{argument.upper()} from {os.getpid()}"


def misbehave(argument: str) -> str:
    """"ok", except: "raise" raises, "hang" sleeps an hour, "die" ends the process, "int" returns 7,
    "flood" returns 30 million characters."""
    if argument == "raise":
        raise ValueError(f"cannot answer {argument!r}")
    if argument == "hang":
        time.sleep(3600.0)
    if argument == "die":
        os._exit(3)
    if argument == "int":
        return 7  # type: ignore[return-value]
    if argument == "flood":
        return "7" * 30_000_000
    return "ok"


def nap(argument: str) -> str:
    """Sleeps float(argument) seconds: calls that overlap only if they run in different workers."""
    time.sleep(float(argument))
    return "rested"


def always_raise(argument: str) -> str:
    """A tool whose every call fails."""
    raise RuntimeError("the service is down")


def two_arguments(argument: str, other: str) -> str:
    """Cannot be called as f(argument): loading it must fail."""
    return argument + other


NOT_CALLABLE = 42


def environment_variable(argument: str) -> str:
    """The worker's value of the environment variable named by the argument, or "<unset>"."""
    return os.environ.get(argument, "<unset>")


def daemon(argument: str) -> str:
    """Starts a process in a session of its own that sleeps an hour (a daemonising library's way:
    fork, setsid, fork again) and writes its pid to the file named by the argument."""
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            with open(argument, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(3600.0)
        os._exit(0)
    os.waitpid(child, 0)
    return "started"
