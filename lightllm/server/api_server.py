"""python -m lightllm.server.api_server: parse flags -> StartArgs -> launch."""
import dataclasses
import sys

from lightllm.server.api_cli import make_argument_parser
from lightllm.server.api_start import _launch_subprocesses
from lightllm.server.core.objs.start_args_type import StartArgs

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def main(argv=None) -> None:
    ns = make_argument_parser().parse_args(argv)
    names = {f.name for f in dataclasses.fields(StartArgs)}
    args = StartArgs(**{k: v for k, v in vars(ns).items() if k in names})
    try:
        _launch_subprocesses(args)
    except KeyboardInterrupt:  # Ctrl-C while starting (a serving server shuts down gracefully instead)
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT_CODE)


if __name__ == "__main__":
    main()
