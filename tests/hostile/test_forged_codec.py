"""A job record rewritten in a shared Redis to claim ``pickle`` (or any other codec) is
refused by every reader that did not opt into it, before a byte of it is decoded: the
attack of issue 11, where ``job.result()`` and ``sandboxq job`` of a JSON-only producer
ran the attacker's code. Every read path goes through ``codec.decode_stored``."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import redis

from sandboxq import Queue
from sandboxq.codec import decode_stored
from sandboxq.errors import CodecRefused, SerializationError

from .support import bomb, cli, forge_completed

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def json_queue(redis_url: str, queue_name: str) -> Queue:
    q = Queue(queue_name, url=redis_url)  # the default: a JSON-only producer
    yield q
    q.close()


def test_result_refuses_a_record_rewritten_to_claim_pickle(
    raw: redis.Redis, json_queue: Queue, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    job = json_queue.enqueue("x")
    forge_completed(raw, json_queue.name, job.id, result=bomb(marker), codec="pickle")
    with pytest.raises(CodecRefused) as caught:
        job.result(timeout_s=5)
    assert not marker.exists(), "the forged pickle ran"
    assert job.id in str(caught.value) and "'pickle'" in str(caught.value)
    assert caught.value.job_id == job.id and caught.value.codec == "pickle"
    assert isinstance(caught.value, SerializationError)


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_cli_job_refuses_a_record_rewritten_to_claim_pickle(
    raw: redis.Redis,
    redis_url: str,
    json_queue: Queue,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    as_json: bool,
) -> None:
    marker = tmp_path / "pwned"
    job = json_queue.enqueue("x")
    forge_completed(raw, json_queue.name, job.id, result=bomb(marker), codec="pickle")
    flags = ["--json"] if as_json else []
    code, out, err = cli(capsys, "job", json_queue.name, job.id, "--url", redis_url, *flags)
    assert not marker.exists(), "the forged pickle ran in `sandboxq job`"
    assert code != 0
    assert job.id in err and "'pickle'" in err and "Traceback" not in out + err
    # the record is still shown, without its result
    assert "completed" in out
    if as_json:
        data = json.loads(out)
        assert "result" not in data and "'pickle'" in data["result_error"]


@pytest.mark.parametrize(
    "claimed",
    ["yaml", "PICKLE", "pickle\x00", "json\x00pickle", "", b"\xff\xfe", "p" * 100_000, " json"],
    ids=["yaml", "upper", "nul-after", "nul-between", "empty", "not-utf8", "huge", "space"],
)
def test_any_codec_but_the_readers_own_is_refused_naming_the_job(
    raw: redis.Redis, json_queue: Queue, tmp_path: Path, claimed: str | bytes
) -> None:
    marker = tmp_path / "pwned"
    job = json_queue.enqueue("x")
    forge_completed(raw, json_queue.name, job.id, result=bomb(marker), codec=claimed)
    with pytest.raises(CodecRefused) as caught:
        job.result(timeout_s=5)
    assert not marker.exists()
    message = str(caught.value)
    assert job.id in message and "claims codec" in message
    assert len(message) < 1000  # a huge codec name is clipped, not echoed


def test_a_pickle_reader_refuses_names_it_does_not_know(
    raw: redis.Redis, redis_url: str, json_queue: Queue, tmp_path: Path
) -> None:
    job = json_queue.enqueue("x")
    forge_completed(raw, json_queue.name, job.id, result=bomb(tmp_path / "m"), codec="dill")
    with Queue(json_queue.name, url=redis_url, codec="pickle") as reader:
        with pytest.raises(CodecRefused, match="'dill'"):
            reader.job(job.id).result(timeout_s=5)


def test_a_missing_codec_field_reads_as_json_and_never_unpickles(
    raw: redis.Redis, json_queue: Queue, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    job = json_queue.enqueue("x")
    forge_completed(raw, json_queue.name, job.id, result=bomb(marker), codec=None)
    with pytest.raises(SerializationError, match=job.id):
        job.result(timeout_s=5)
    assert not marker.exists()


def test_pickle_is_read_only_by_a_reader_that_opted_in(
    raw: redis.Redis, redis_url: str, json_queue: Queue, capsys: pytest.CaptureFixture[str]
) -> None:
    job = json_queue.enqueue("x")
    forge_completed(raw, json_queue.name, job.id, result=pickle.dumps({1, 2}), codec="pickle")
    with Queue(json_queue.name, url=redis_url, codec="pickle") as reader:
        assert reader.job(job.id).result(timeout_s=5) == {1, 2}
    with Queue(json_queue.name, url=redis_url, allow_pickle=True) as reader:
        assert reader.job(job.id).result(timeout_s=5) == {1, 2}
    code, out, err = cli(
        capsys, "job", json_queue.name, job.id, "--url", redis_url, "--allow-pickle", "--json"
    )
    assert code == 0, err
    assert sorted(json.loads(out)["result"]) == [1, 2]  # a set, shown as JSON can


def test_decode_stored_is_the_one_gate() -> None:
    """What a later reader (a dashboard, an asyncio client) calls with its own bytes."""
    assert decode_stored(b"[1]", b"json", allowed={"json"}, job_id="j") == [1]
    with pytest.raises(CodecRefused):
        decode_stored(pickle.dumps(1), b"pickle", allowed={"json"}, job_id="j")
    with pytest.raises(SerializationError, match="read limit of 4 bytes"):
        decode_stored(b"[1, 2]", "json", allowed={"json"}, job_id="j", max_bytes=4)
