"""The Files API end to end, with the `openai` SDK as client: content in the NATS Object Store,
rows in the PostgreSQL ledger (through the recorder), owned by the uploading principal, bounded."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import openai
import pytest
from openai.types import FileDeleted, FileObject

from apps.gateway.file_store import MAX_CUSTOM_ID_CHARS
from tests.e2e.conftest import System
from tests.support import eventually
from tests.system import KeyedGateway, api_keys_file, keyed_gateway

ALICE, BOB, CAROL = "sk-alice-files", "sk-bob-files", "sk-carol-files"
MAX_FILE_BYTES = 4 << 20
MAX_LINES = 5
MAX_LINE_BYTES = 4096
MAX_FILES = 6


def start_gateway(system: System, keys: Path) -> KeyedGateway:
    return keyed_gateway(system, keys, ALICE, env={
        "HELEXA_MAX_FILE_BYTES": str(MAX_FILE_BYTES), "HELEXA_MAX_BATCH_LINES": str(MAX_LINES),
        "HELEXA_MAX_BATCH_LINE_BYTES": str(MAX_LINE_BYTES), "HELEXA_MAX_FILES_PER_PRINCIPAL": str(MAX_FILES)})


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return api_keys_file(tmp_path_factory.mktemp("keys"),
                         {ALICE: "files-alice", BOB: "files-bob", CAROL: "files-carol"})


@pytest.fixture(scope="module")
def gateway(system: System, keys: Path) -> Iterator[KeyedGateway]:
    started = start_gateway(system, keys)
    try:
        yield started
    finally:
        started.process.stop()


def batch_lines(n: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}).encode()
                    + b"\n" for i in range(n))


def ledger_row(system: System, file_id: str) -> dict | None:
    async def read() -> dict | None:
        conn = await asyncpg.connect(system.database_url)
        try:
            row = await conn.fetchrow("SELECT * FROM files WHERE file_id = $1", file_id)
            return dict(row) if row is not None else None
        finally:
            await conn.close()

    return asyncio.run(read())


def test_upload_list_retrieve_download_delete(system: System, gateway: KeyedGateway, tmp_path: Path) -> None:
    client = gateway.client()
    content = batch_lines(3)
    created = client.files.create(file=("requests.jsonl", content), purpose="batch")
    FileObject.model_validate(created.model_dump(), strict=True)
    assert created.id.startswith("file-") and len(created.id) == 5 + 44
    assert (created.bytes, created.filename, created.purpose, created.object) == (len(content), "requests.jsonl",
                                                                                  "batch", "file")
    # Right away: this gateway knows its own file before the recorder projects it.
    assert client.files.retrieve(created.id) == created
    assert client.files.content(created.id).content == content

    other = client.files.create(file=("notes.txt", b"plain \x00 bytes, any content"), purpose="user_data")
    listed = client.files.list()
    ids = [f.id for f in listed.data]
    assert ids.index(other.id) < ids.index(created.id)  # newest first
    assert [f.id for f in client.files.list(purpose="batch").data] == [f.id for f in listed.data
                                                                        if f.purpose == "batch"]
    ascending = [f.id for f in client.files.list(order="asc").data]
    assert ascending == sorted(ascending)
    first = client.files.list(limit=1)
    assert len(first.data) == 1 and first.has_more and first.data[0].id == ids[0]
    assert first.get_next_page().data[0].id == ids[1]

    eventually(lambda: ledger_row(system, created.id), 30, message="the recorder never projected the file")
    row = ledger_row(system, created.id)
    assert row is not None
    assert (row["principal"], row["bytes"], row["purpose"]) == ("files-alice", len(content), "batch")

    deleted = client.files.delete(created.id)
    FileDeleted.model_validate(deleted.model_dump(), strict=True)
    assert (deleted.id, deleted.deleted) == (created.id, True)
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(created.id)
    assert created.id not in [f.id for f in client.files.list().data]
    eventually(lambda: (ledger_row(system, created.id) or {}).get("deleted_at") is not None, 30,
               message="the recorder never marked the file deleted")
    client.files.delete(other.id)


def test_another_principal_cannot_see_read_or_delete(gateway: KeyedGateway) -> None:
    mine = gateway.client().files.create(file=("secret.txt", b"42"), purpose="user_data")
    bob = gateway.client(BOB)
    for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
        with pytest.raises(openai.NotFoundError) as caught:
            call(mine.id)
        assert caught.value.body["code"] == "file_not_found"
    assert mine.id not in [f.id for f in bob.files.list().data]
    with pytest.raises(openai.NotFoundError) as missing:
        bob.files.retrieve("file-" + "0" * 44)
    assert missing.value.body["message"].replace("0" * 44, "") == caught.value.body["message"].replace(
        mine.id.removeprefix("file-"), "")
    assert gateway.client().files.content(mine.id).content == b"42"
    gateway.client().files.delete(mine.id)


def file_first(name: str, content: bytes, purpose: str | None) -> tuple[bytes, str]:
    """A form whose `file` part comes before `purpose`, as openai-node sends `{file, purpose}`."""
    boundary = "node-order-boundary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n").encode() + content + b"\r\n"
    if purpose is not None:
        body += f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'.encode()
    return body + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def test_the_file_may_come_before_its_purpose_and_is_checked_for_it(system: System, gateway: KeyedGateway) -> None:
    def upload(name: str, content: bytes, purpose: str | None) -> httpx.Response:
        body, kind = file_first(name, content, purpose)
        return httpx.post(f"{gateway.url}/v1/files", content=body, timeout=60,
                          headers={"Authorization": f"Bearer {CAROL}", "Content-Type": kind})

    client = gateway.client(CAROL)
    long_line = b"x" * (MAX_LINE_BYTES + 10) + b"\n"
    kept = upload("notes.txt", long_line, "user_data")  # no batch checks for a user_data file
    assert kept.status_code == 200, kept.text
    assert kept.json()["purpose"] == "user_data" and client.files.content(kept.json()["id"]).content == long_line
    batch = upload("lines.jsonl", batch_lines(2), "batch")
    assert batch.status_code == 200 and batch.json()["purpose"] == "batch"
    # A chat stream on the same gateway runs to its end beside the refused uploads.
    stream = client.chat.completions.create(model=system.model, stream=True, max_tokens=16, temperature=0,
                                            messages=[{"role": "user", "content": "Count to five."}])
    chunks = iter(stream)
    first = next(chunks)
    for content, purpose, status, param in ((long_line, "batch", 413, "file"), (b"not json\n", "batch", 400, "file"),
                                            (b"a", "fine-tune", 400, "purpose"), (b"a", None, 400, "purpose")):
        refused = upload("refused.jsonl", content, purpose)
        assert (refused.status_code, refused.json()["error"]["param"]) == (status, param), refused.text
    finish = [c.choices[0].finish_reason for c in [first, *chunks] if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    # Nothing of the refused uploads is kept.
    assert sorted(f.filename for f in client.files.list().data) == ["lines.jsonl", "notes.txt"]


def test_bounds_name_what_they_bound(gateway: KeyedGateway) -> None:
    client = gateway.client(BOB)
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("big.bin", b"x" * (MAX_FILE_BYTES + 1)), purpose="user_data")
    assert caught.value.status_code == 413 and "max_file_bytes" in caught.value.body["message"]
    assert caught.value.body["param"] == "file"

    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("many.jsonl", batch_lines(MAX_LINES + 1)), purpose="batch")
    assert caught.value.status_code == 413 and "max_batch_lines" in caught.value.body["message"]

    long_line = json.dumps({"custom_id": "x" * MAX_LINE_BYTES}).encode() + b"\n"
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("long.jsonl", long_line), purpose="batch")
    assert caught.value.status_code == 413 and "max_batch_line_bytes" in caught.value.body["message"]

    bad = batch_lines(2) + b"{not json\n" + batch_lines(1)
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad.jsonl", bad), purpose="batch")
    assert caught.value.body["param"] == "file" and "Line 3 " in caught.value.body["message"]

    # A custom_id the ledger could not index (one row per batch and custom_id) is refused at upload.
    long_id = json.dumps({"custom_id": "c" * (MAX_CUSTOM_ID_CHARS + 1)}).encode() + b"\n"
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("long-id.jsonl", batch_lines(1) + long_id), purpose="batch")
    assert caught.value.body["param"] == "file" and "Line 2 " in caught.value.body["message"]
    assert "custom_id" in caught.value.body["message"]

    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("a.txt", b"a"), purpose="fine-tune")
    assert caught.value.body["param"] == "purpose"
    # Nothing refused was kept.
    assert client.files.list().data == []

    kept = [client.files.create(file=(f"{i}.txt", b"a"), purpose="user_data") for i in range(MAX_FILES)]
    with pytest.raises(openai.APIStatusError) as caught:
        client.files.create(file=("one-more.txt", b"a"), purpose="user_data")
    assert caught.value.status_code == 413 and "max_files_per_principal" in caught.value.body["message"]
    for stored in kept:
        client.files.delete(stored.id)
    assert client.files.list().data == []


def test_a_chat_stream_finishes_while_a_large_upload_runs(system: System, gateway: KeyedGateway) -> None:
    """The upload's body is held open (half sent) until the chat stream has finished: the stream
    cannot be waiting on the upload."""
    chat_done, half_sent = threading.Event(), threading.Event()
    boundary = "helexa-test-boundary"
    piece = b"y" * (256 << 10)

    def body() -> Iterator[bytes]:
        yield (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nuser_data\r\n'
               f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="large.bin"\r\n'
               "Content-Type: application/octet-stream\r\n\r\n").encode()
        for _ in range(6):
            yield piece
        half_sent.set()
        assert chat_done.wait(120)
        for _ in range(6):
            yield piece
        yield f"\r\n--{boundary}--\r\n".encode()

    answer: dict[str, httpx.Response] = {}

    def upload() -> None:
        answer["upload"] = httpx.post(f"{gateway.url}/v1/files", content=body(), timeout=180, headers={
            "Authorization": f"Bearer {ALICE}", "Content-Type": f"multipart/form-data; boundary={boundary}"})

    uploader = threading.Thread(target=upload)
    uploader.start()
    try:
        assert half_sent.wait(60)
        stream = gateway.client().chat.completions.create(
            model=system.model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=8, stream=True)
        finishes = [choice.finish_reason for chunk in stream for choice in chunk.choices if choice.finish_reason]
        assert finishes and uploader.is_alive()
    finally:
        chat_done.set()
        uploader.join(180)
    response = answer["upload"]
    assert response.status_code == 200, response.text
    stored = FileObject.model_validate(response.json(), strict=True)
    assert stored.bytes == 12 * len(piece)
    client = gateway.client()
    assert client.files.content(stored.id).content == piece * 12
    client.files.delete(stored.id)


def test_another_gateway_serves_a_file_uploaded_a_moment_ago(system: System, gateway: KeyedGateway, keys: Path) -> None:
    """Straight to a second gateway, before the recorder may have projected it: that gateway waits
    for the recorder's notice, then reads the ledger; the content is the bucket's."""
    other = start_gateway(system, keys)
    try:
        content = batch_lines(2)
        uploaded = gateway.client().files.create(file=("across.jsonl", content), purpose="batch")
        assert other.client().files.retrieve(uploaded.id) == uploaded
        assert other.client().files.content(uploaded.id).content == content
        with pytest.raises(openai.NotFoundError):
            other.client(BOB).files.retrieve(uploaded.id)
        other.client().files.delete(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            other.client().files.content(uploaded.id)
        eventually(lambda: uploaded.id not in [f.id for f in gateway.client().files.list().data], 30,
                   message="the first gateway still lists a file deleted through the second")
    finally:
        other.process.stop()
