"""Signal handlers set for the length of a block."""
import signal
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, Union

Handler = Union[Callable, int]  # a function, signal.SIG_IGN or signal.SIG_DFL


@contextmanager
def signal_handlers(signals: Sequence[int], handler: Handler) -> Iterator[None]:
    """``handler`` for ``signals`` inside the block, the previous ones restored after it. Outside the
    main thread (where Python lets no handler be set) the block runs with the handlers as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, prev in previous.items():
            signal.signal(sig, prev)
