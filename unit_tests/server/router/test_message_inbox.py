"""The router's inbox (MessageInbox): messages in order, a shut-down None ends it, a broken pipe
counts as a shut-down, a message that does not unpickle is skipped."""
import queue

from lightllm.server.router.manager import MessageInbox


class _Pipe:
    """in_q's get(): each item is returned in turn, or raised when it is an exception."""

    def __init__(self, items):
        self._items = queue.Queue()
        for x in items:
            self._items.put(x)

    def get(self):
        x = self._items.get()
        if isinstance(x, BaseException):
            raise x
        return x


def _drain(inbox: MessageInbox, want: int) -> list:
    got = []
    while len(got) < want:
        got.extend(inbox.poll(block=True))
    return got


def test_messages_come_in_order_and_none_ends():
    inbox = MessageInbox(_Pipe(["a", "b", "c", None]))
    assert _drain(inbox, 4) == ["a", "b", "c", None]
    inbox._thread.join(timeout=5)
    assert not inbox._thread.is_alive()


def test_an_unreadable_message_is_skipped():
    inbox = MessageInbox(_Pipe(["a", AttributeError("no such class"), "b", None]))
    assert _drain(inbox, 3) == ["a", "b", None]


def test_a_broken_pipe_reads_as_a_shutdown():
    inbox = MessageInbox(_Pipe(["a", EOFError()]))
    assert _drain(inbox, 2) == ["a", None]


def test_poll_without_blocking_returns_what_is_there():
    pipe = queue.Queue()
    inbox = MessageInbox(pipe)
    assert inbox.poll(block=False) == []
    pipe.put("x")
    assert _drain(inbox, 1) == ["x"]
    pipe.put(None)
