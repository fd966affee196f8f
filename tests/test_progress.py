"""syncless.tqdm: the postfix shows what the logger has delivered, never a live tensor."""
import io
import re

import pytest
import torch

import syncless
from syncless.progress import tqdm


def postfixes(text):
    """The distinct postfixes, in the order the bar drew them."""
    shown = []
    for postfix in re.findall(r"it/s, ([^\]]*)\]", text):
        if not shown or shown[-1] != postfix:
            shown.append(postfix)
    return shown


def test_postfix_follows_delivered_values(device):
    values = torch.arange(12, dtype=torch.float32, device=device) / 4
    out = io.StringIO()
    with syncless.Logger(every=100) as log:
        bar = tqdm(total=12, log=log, file=out, mininterval=0, ascii=True)
        for i in range(12):
            log(loss=values[i], step_no=i)
            if i % 3 == 2:
                log.flush()                      # delivery, made deterministic for the test
            bar.update(1)                        # a redraw: the postfix is read here
        bar.close()
    shown = postfixes(out.getvalue())
    # Nothing before the first delivery, then each delivered row once, never a newer one.
    assert shown == [f"loss={s / 4:.4g}, step_no={s}, @{s}" for s in (2, 5, 8, 11)]


def test_keys_and_objects_with_latest():
    class Board:                             # anything with a `latest` dict will do
        latest = {"loss": 0.125, "lr": 3e-4, "name": "x"}

    out = io.StringIO()
    bar = tqdm(total=2, log=Board(), keys=["lr", "name", "missing"], fmt=".1e", file=out,
               mininterval=0, ascii=True)
    bar.update(2)
    bar.close()
    assert "lr=3.0e-04, name=x]" in out.getvalue()


def test_plain_tqdm_without_log():
    out = io.StringIO()
    assert list(tqdm([1, 2, 3], file=out, ascii=True)) == [1, 2, 3]
    assert "3/3" in out.getvalue()


def test_missing_tqdm_names_the_extra(monkeypatch):
    import syncless.progress as progress
    monkeypatch.setattr(progress, "_classes", {})
    monkeypatch.setitem(__import__("sys").modules, "tqdm.std", None)
    with pytest.raises(ImportError, match=r"pip install tqdm .*pip install -e '\.\[progress\]'"):
        tqdm(range(3))


def test_bad_arguments_fail_at_construction_not_at_a_redraw():
    with pytest.raises(TypeError, match=r"keys must be a list of metric names, got the str "
                                        r"'loss' \(keys=\['loss'\] shows one\)"):
        tqdm(range(3), log=syncless.Logger(), keys="loss")
    with pytest.raises(ValueError, match=r"fmt 'd' is not a format spec for a float"):
        tqdm(range(3), log=syncless.Logger(), fmt="d")
    with pytest.raises(TypeError, match=r"log must have a `latest` dict .* got dict"):
        tqdm(range(3), log={"loss": 1.0})
    out = io.StringIO()                       # keys from a generator are kept, not consumed
    log = type("Board", (), {"latest": {"a": 1.0, "b": 2.0}})()
    bar = tqdm(total=1, log=log, keys=(k for k in ["b"]), file=out, mininterval=0, ascii=True)
    bar.update(1)
    bar.close()
    assert postfixes(out.getvalue())[-1] == "b=2"


def test_a_failing_postfix_never_stops_the_loop(caplog):
    class Flaky:                              # `latest` that fails after the first redraw
        reads = 0

        @property
        def latest(self):
            self.reads += 1                   # read 1: tqdm() checks it; read 2: first redraw
            if self.reads > 2:
                raise RuntimeError("backend gone")
            return {"loss": 0.5}

    out = io.StringIO()
    seen = list(tqdm(range(5), log=Flaky(), file=out, mininterval=0, ascii=True))
    assert seen == [0, 1, 2, 3, 4]
    assert "5/5" in out.getvalue() and "loss=0.5" in out.getvalue()
    failures = [r for r in caplog.records if "building the postfix" in r.getMessage()]
    assert len(failures) == 1 and "RuntimeError: backend gone" in failures[0].getMessage()


class Counted:
    """An iterable that counts the iterators made from it."""

    def __init__(self, items):
        self.items = list(items)
        self.iters = 0

    def __iter__(self):
        self.iters += 1
        return iter(self.items)


class Sized(Counted):
    def __len__(self):
        return len(self.items)


def test_the_iterable_is_iterated_once_and_its_len_shown():
    out = io.StringIO()
    source = Sized(range(7))
    with syncless.Logger() as log:
        assert list(tqdm(source, log=log, file=out, mininterval=0, ascii=True)) == list(range(7))
    assert source.iters == 1
    assert "7/7" in out.getvalue()
    unsized = Counted(range(4))
    assert list(tqdm(unsized, file=out, ascii=True)) == [0, 1, 2, 3]
    assert unsized.iters == 1 and "4it" in out.getvalue()


def test_async_for_iterates_once():
    import asyncio

    async def consume(bar):
        return [x async for x in bar]

    source = Sized(range(5))
    out = io.StringIO()
    bar = tqdm(source, file=out, mininterval=0, ascii=True)
    assert asyncio.run(consume(bar)) == [0, 1, 2, 3, 4]
    assert source.iters == 1 and "5/5" in out.getvalue()


def batches(bar_class, workers, **kwargs):
    """The batches a shuffled DataLoader yields through a progress bar, seeded as a user seeds."""
    data = torch.utils.data.TensorDataset(torch.arange(64))
    torch.manual_seed(1234)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, num_workers=workers)
    return [batch[0].tolist() for batch in bar_class(loader, file=io.StringIO(), **kwargs)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shuffled_loader_yields_the_batches_plain_tqdm_gives(workers):
    import tqdm as plain
    expected = batches(plain.tqdm, workers)
    with syncless.Logger() as log:
        got = batches(tqdm, workers, log=log)
    assert got == expected
    assert sorted(x for batch in got for x in batch) == list(range(64))
    assert expected != [list(range(i, i + 8)) for i in range(0, 64, 8)]     # really shuffled
