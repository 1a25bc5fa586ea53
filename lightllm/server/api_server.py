"""python -m lightllm.server.api_server: parse flags -> StartArgs -> launch."""
import dataclasses
import signal
import sys

from lightllm.server.api_cli import make_argument_parser
from lightllm.server.api_start import _launch_subprocesses
from lightllm.server.core.objs.start_args_type import StartArgs

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
TERMINATED_EXIT_CODE = 143  # 128 + SIGTERM


class StartupTerminated(BaseException):
    """SIGTERM before the server serves (a BaseException, as KeyboardInterrupt: no ``except Exception``
    swallows it); once it serves, the server's own handler shuts it down gracefully."""


def _terminated(signum, frame) -> None:
    raise StartupTerminated()


def main(argv=None) -> None:
    ns = make_argument_parser().parse_args(argv)
    names = {f.name for f in dataclasses.fields(StartArgs)}
    args = StartArgs(**{k: v for k, v in vars(ns).items() if k in names})
    signal.signal(signal.SIGTERM, _terminated)  # a clean exit (workers stopped, queues closed), not a kill
    try:
        _launch_subprocesses(args)
    except KeyboardInterrupt:  # Ctrl-C while starting (a serving server shuts down gracefully instead)
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT_CODE)
    except StartupTerminated:
        print("terminated", file=sys.stderr)
        sys.exit(TERMINATED_EXIT_CODE)


if __name__ == "__main__":
    main()
