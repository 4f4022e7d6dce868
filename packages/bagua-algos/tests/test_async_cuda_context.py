"""AsyncModelAverage's averaging thread on a GPU rank, checked on CPU with torch.cuda faked:
the thread makes the weights' device current (a new thread starts on device 0) and runs on a
stream of its own, and every round waits for the training stream's last step."""

import threading
import types

import torch

from bagua_algos.algorithms import async_model_average as amod


def test_the_thread_uses_the_device_captured_at_init_and_its_own_stream(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: seen.append(("set_device", d, threading.current_thread())))
    monkeypatch.setattr(torch.cuda, "Stream", lambda d: ("stream", d))

    class Ctx:
        def __init__(self, s):
            seen.append(("stream", s, threading.current_thread()))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    dev = torch.device("cuda", 1)
    impl = types.SimpleNamespace(device=dev, error=None, stopped=False)
    impl._rounds = lambda: seen.append(("rounds", None, threading.current_thread()))
    t = threading.Thread(target=amod.AsyncModelAverageImpl._loop, args=(impl,))
    t.start()
    t.join()
    assert impl.error is None
    assert [(k, v) for k, v, _ in seen] == [("set_device", dev), ("stream", ("stream", dev)),
                                           ("rounds", None)]
    assert all(th is t for _, _, th in seen)          # all of it on the averaging thread
    seen.clear()
    impl.device = torch.device("cpu")
    amod.AsyncModelAverageImpl._loop(impl)
    assert [k for k, _, _ in seen] == ["rounds"]      # CPU weights: no CUDA call at all


def test_each_round_waits_for_the_training_streams_last_step(monkeypatch):
    waits = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda d=None: types.SimpleNamespace(wait_event=waits.append))
    impl = types.SimpleNamespace(_train_done="step event", device=torch.device("cuda", 0))
    amod.AsyncModelAverageImpl._after_training(impl)
    assert waits == ["step event"]
