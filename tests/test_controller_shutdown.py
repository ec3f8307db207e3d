"""The controller's shutdown over real sockets: a rank that acknowledged the shutdown and
closed its connection is a clean exit even while another rank's acknowledgement is still on
its way; a rank that closes without acknowledging is lost, and named."""

import socket
import threading
import time

import pytest

from rlhf.controller import wire
from rlhf.controller.controller import Controller
from rlhf.controller.errors import RankLostError
from rlhf.controller.messages import Bye, Shutdown


def _rank(sock: socket.socket, rank: int, delay_s: float, acknowledge: bool) -> None:
    msg, _, _ = wire.recv_msg(sock)
    assert isinstance(msg, Shutdown)
    time.sleep(delay_s)
    if acknowledge:
        wire.send_msg(sock, Bye(rank))
    sock.close()


def _shutdown(behaviour: dict[int, tuple[float, bool]]) -> None:
    pairs = {r: socket.socketpair() for r in behaviour}
    ranks = [threading.Thread(target=_rank, args=(pairs[r][1], r, *b)) for r, b in
             behaviour.items()]
    for t in ranks:
        t.start()
    try:
        Controller({r: p[0] for r, p in pairs.items()}, {}).shutdown(timeout_s=10)
    finally:
        for t in ranks:
            t.join()


def test_early_closer_after_its_bye_is_a_clean_exit():
    # rank 0 says bye and closes at once; rank 1 takes a while: no rank is lost
    _shutdown({0: (0.0, True), 1: (0.3, True), 2: (0.0, True)})


def test_closing_without_bye_names_the_rank():
    with pytest.raises(RankLostError, match="rank 1.*shutdown"):
        _shutdown({0: (0.0, True), 1: (0.1, False)})
