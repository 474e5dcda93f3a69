"""Sessions: tests, lint, typecheck, docs, bench. Each installs what it needs into its own venv."""

import shutil
import subprocess
from pathlib import Path

import nox

TOKENSPEED = (
    "tokenspeed==0.1.1"  # the peer the drop-in is compared with (tests/interop/test_dropin.py)
)
DYNAMO = "ai-dynamo-runtime==1.6.1"  # its indexer and radix tree read tskv's stream (test_dynamo)

nox.options.sessions = ["tests", "lint", "typecheck", "docs", "sanitize"]
nox.options.reuse_existing_virtualenvs = True


def tokenspeed_wheel(session: nox.Session) -> dict[str, str]:
    """TokenSpeed's wheel, without its dependencies (only its kv_events.py is loaded, which
    needs pydantic beside msgspec and pyzmq): the environment that names it for the tests, or
    none where it cannot be had (the drop-in tests then skip, saying so)."""
    folder = Path(session.create_tmp()).resolve() / "peers"
    try:
        session.run(
            "python", "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), TOKENSPEED
        )
        session.install("pydantic")
    except nox.command.CommandFailed:
        session.log(f"{TOKENSPEED} cannot be had here: the drop-in comparison is skipped")
        return {}
    wheels = sorted(folder.glob("tokenspeed-*.whl"))
    return {"TSKV_TOKENSPEED_WHEEL": str(wheels[-1])} if wheels else {}


def install_dynamo(session: nox.Session) -> None:
    """Dynamo's indexer and radix tree, where its wheels exist (Linux x86-64); elsewhere the
    tests that run them skip, saying so."""
    try:
        session.install(DYNAMO)
    except nox.command.CommandFailed:
        session.log(f"{DYNAMO} does not install here: its interop tests are skipped")


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test,plot,serve]")  # plot: the --plot test draws a real chart
    install_dynamo(session)
    session.run("pytest", *session.posargs, env=tokenspeed_wheel(session))
    if not session.posargs:  # and the events, codec and subscriber as a machine without msgspec
        without = [
            "tests/core/test_events.py",
            "tests/core/test_codec.py",
            "tests/core/test_read_batch.py",  # the compiled reader against msgpack's decoder
            "tests/interop/test_engines.py",
            "tests/shells/test_faults.py",
        ]
        session.run("pytest", "-q", *without, env={"TSKV_CODEC": "msgpack"})
        # and the index's keys, walks and holdings in Python, the reference, where the
        # compiled key walk (built by the install above where a C compiler is) ran them first
        pure = [
            "tests/core/test_block_keys.py",
            "tests/core/test_compiled.py",
            "tests/core/test_fast_path.py",
            "tests/core/test_hybrid_groups.py",
            "tests/core/test_predictions.py",
            "tests/core/test_prefix_index.py",
            "tests/core/test_reader_messages.py",  # a report's keys: packed by array("q")
            "tests/shells/test_watcher.py",
        ]
        session.run("pytest", "-q", *pure, env={"TSKV_PURE_PYTHON": "1"})


SANITIZED = [  # the compiled core's own tests, and the index's oracle tests that drive it
    "tests/core/test_compiled.py",
    "tests/core/test_fast_path.py",
    "tests/core/test_prefix_index.py",
    "tests/core/test_block_keys.py",
    "tests/core/test_hybrid_groups.py",
    "tests/core/test_predictions.py",
    "tests/core/test_reader_messages.py",
    "tests/core/test_read_batch.py",
]
SANITIZERS = "-fsanitize=address,undefined"


@nox.session
def sanitize(session: nox.Session) -> None:
    """The compiled core built with AddressSanitizer and UndefinedBehaviorSanitizer, and its
    tests run under them. In a copy of the tree: an ASan build in the tree itself would be
    loaded by every other session without the ASan runtime first, and fail there."""
    tree = Path(session.create_tmp()).resolve() / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(
        Path.cwd(),
        tree,
        ignore=shutil.ignore_patterns(".nox", ".git", "build", "*.so", "__pycache__", ".*cache"),
    )
    session.install(f"{tree}[test]")  # the dependencies; the tree's own build shadows this one
    session.chdir(tree)
    # -UNDEBUG: the asserts that stand for the bounds the code relies on are checked too
    flags = f"{SANITIZERS} -fno-omit-frame-pointer -fno-sanitize-recover=undefined -O1 -g -UNDEBUG"
    build = {"CFLAGS": flags, "LDFLAGS": SANITIZERS}
    session.run("python", "setup.py", "-q", "build_ext", "--inplace", "--force", env=build)
    runtime = subprocess.run(
        ["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    ).stdout.strip()
    env = {
        "LD_PRELOAD": runtime,  # the interpreter is not instrumented: the runtime goes first
        "ASAN_OPTIONS": "detect_leaks=0",  # CPython leaves its own objects at exit
        "PYTHONMALLOC": "malloc",  # every object from malloc, so ASan sees each one freed
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        "TSKV_PURE_PYTHON": "0",
        "TSKV_EXAMPLES_SCALE": "2",  # each property twice the examples the tests run
    }
    loaded = "import tskv.core.compiled as c; assert c.core is not None, 'no compiled core'"
    session.run("python", "-c", loaded, env=env)
    session.run("pytest", "-q", "-p", "no:cacheprovider", *SANITIZED, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[fast,serve]", "mypy==2.4.1", "exceptiongroup", "pytest", "tomli")
    session.run("mypy", "tskv")


@nox.session
def docs(session: nox.Session) -> None:
    """The manual and the API reference, built as a reader gets them: any warning fails."""
    session.install("-e", ".[docs,serve]")  # the service's module is in the reference
    out = Path(session.create_tmp()) / "html"
    session.run("sphinx-build", "-W", "--keep-going", "-q", "-b", "html", "docs", str(out))
    session.log(f"built: {out / 'index.html'}")


@nox.session
def bench(session: nox.Session) -> None:
    session.install("-e", ".[fast,test,serve]")
    install_dynamo(session)  # the Dynamo columns, where it installs
    session.run("python", "-m", "benchmarks", *session.posargs)
