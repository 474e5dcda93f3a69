"""Sessions: tests, lint, typecheck, bench. Each installs what it needs into its own venv."""

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)
    if not session.posargs:  # and the events, codec and subscriber as a machine without msgspec
        without = [
            "tests/test_events.py",
            "tests/test_codec.py",
            "tests/test_engines.py",
            "tests/test_faults.py",
        ]
        session.run("pytest", "-q", *without, env={"TSKV_CODEC": "msgpack"})


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[fast]", "mypy==2.4.1", "exceptiongroup", "pytest")
    session.run("mypy", "tskv")


@nox.session
def bench(session: nox.Session) -> None:
    session.install("-e", ".[fast,test]")
    try:  # Dynamo's index, to compare with (Linux x86-64 wheels only); optional
        session.install("ai-dynamo-runtime")
    except nox.command.CommandFailed:
        session.log("ai-dynamo-runtime does not install here: the Dynamo columns are skipped")
    else:  # Dynamo's own ZMQ indexer reads tskv's stream on both wires
        session.run("pytest", "-q", "tests/test_dynamo.py")
    session.run("python", "-m", "tskv.bench", *session.posargs)
