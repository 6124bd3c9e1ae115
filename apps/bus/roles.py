"""Who may do what on the bus: one NATS user per role, with publish and subscribe allow-lists.

The roles are the apps (gateway, worker, recorder, bench) and the operator, who may read everything
(`helexa bus sub`, `helexa models`) but write nothing an app owns. An administrator (`helexa up`
itself, `helexa bus setup`) declares the streams; no app may create, change or purge one.

What each role may touch follows from `apps.bus.topology`, which names every helexa subject; the
JetStream API subjects below (`$JS.API.…`, `$KV.…`, `$O.…`) are NATS's own. In short:

- **gateway** publishes requests (the only role that may: a request's `principal` and `attempt`
  are the gateway's), cancels, and the events it owns: admission decisions, stored and deleted
  responses, created and deleted files, and `worker_lost` (the run a lost worker cannot report). It
  stores large requests, reads the node registry, and alone writes, reads and deletes uploaded files
  (the `helexa_files` bucket; the recorder never touches their content). Replies come to
  `_INBOX.gateway.<user>`, which only it may read.
- **worker** takes requests only through its model's consumer (it may not subscribe to
  `helexa.req.>` nor read REQUESTS otherwise), reads and deletes large requests, writes the node
  registry, publishes run and node events and `dropped` admissions, answers its micro-service
  endpoints and publishes reply frames to gateways' inboxes (which it may not read).
- **recorder** reads EVENTS through its consumers, trims what it recorded, erases a deleted
  response's event, and reads and deletes large events' objects. **bench** publishes bench runs
  and scores.
- Every role that publishes events may write the `helexa_events` bucket (an event too large for
  one message goes there): its reference carries the object's digest, so only the object the
  event's own role stored is recorded.
- **operator** subscribes to everything; it publishes only to the workers' endpoints (models
  load and unload) and to the read-only JetStream API.

Events are accepted only from the role that owns their kind: permissions keep the subjects apart,
and the recorder refuses an event whose body is not the kind its subject says (`event_refused`).

Which worker may answer a request is not a permission: the gateway's reply subject for a request
ends in 128 random bits (`apps.gateway.bus_client`), so only a worker that was delivered the
request knows where to send its frames, and workers may not subscribe to gateways' inboxes to
learn it; a migrated request gets a new one. See docs/operations.md.
"""

from __future__ import annotations

import json
from typing import Any

from nats.js.object_store import OBJ_STREAM_TEMPLATE

from apps.bus import declaration, events, topology
from apps.bus.codes import RunStatus

GATEWAY, WORKER, RECORDER, BENCH, OPERATOR = "gateway", "worker", "recorder", "bench", "operator"
ROLES = (GATEWAY, WORKER, RECORDER, BENCH, OPERATOR)

_API = "$JS.API"
_KV_STREAM = f"KV_{topology.NODES_BUCKET}"
_OBJ_STREAM = OBJ_STREAM_TEMPLATE.format(bucket=topology.LARGE_REQUESTS_BUCKET)
_OBJ_SUBJECTS = f"$O.{topology.LARGE_REQUESTS_BUCKET}"
_EVENTS_OBJ_STREAM = OBJ_STREAM_TEMPLATE.format(bucket=topology.LARGE_EVENTS_BUCKET)
_EVENTS_OBJ_SUBJECTS = f"$O.{topology.LARGE_EVENTS_BUCKET}"
_FILES_OBJ_STREAM = OBJ_STREAM_TEMPLATE.format(bucket=topology.FILES_BUCKET)
_FILES_OBJ_SUBJECTS = f"$O.{topology.FILES_BUCKET}"

def _kind(event_type: type[events.Event]) -> str:
    return events.kind_of(event_type)


# Event kind (of the body) → the subject kinds it may arrive on, each with the one role that may
# publish there. The routed subjects carry a kind on another role's behalf (`topology.WORKER_LOST`,
# `topology.DROPPED`), with what such an event may say checked by `event_refused`.
EVENT_SUBJECTS: dict[str, dict[str, str]] = {
    _kind(events.RunStarted): {_kind(events.RunStarted): WORKER},
    _kind(events.RunPreempted): {_kind(events.RunPreempted): WORKER},
    _kind(events.RunFinished): {_kind(events.RunFinished): WORKER,
                              topology.WORKER_LOST: GATEWAY},
    _kind(events.NodeStatusChanged): {_kind(events.NodeStatusChanged): WORKER},
    _kind(events.CoreRestarted): {_kind(events.CoreRestarted): WORKER},
    _kind(events.AdmissionDecided): {_kind(events.AdmissionDecided): GATEWAY,
                                                topology.DROPPED: WORKER},
    _kind(events.ResponseStored): {_kind(events.ResponseStored): GATEWAY},
    _kind(events.ResponseDeleted): {_kind(events.ResponseDeleted): GATEWAY},
    _kind(events.FileCreated): {_kind(events.FileCreated): GATEWAY},
    _kind(events.FileDeleted): {_kind(events.FileDeleted): GATEWAY},
    _kind(events.BatchCreated): {_kind(events.BatchCreated): GATEWAY},
    _kind(events.BatchStatus): {_kind(events.BatchStatus): GATEWAY},
    _kind(events.BatchLine): {_kind(events.BatchLine): GATEWAY},
    _kind(events.BenchRunRecorded): {_kind(events.BenchRunRecorded): BENCH},
    _kind(events.ScoreRecorded): {_kind(events.ScoreRecorded): BENCH},
}


_SUBJECT_PUBLISHER = {subject: role for subjects in EVENT_SUBJECTS.values() for subject, role in subjects.items()}


def event_publisher(subject: str) -> str | None:
    """The one role that may publish events on `subject` (None: not an event subject)."""
    kind = topology.kind_of_subject(subject)
    return None if kind is None else _SUBJECT_PUBLISHER.get(kind)


def event_subject_kinds(role: str) -> list[str]:
    """The subject kinds `role` may publish events on."""
    return sorted(subject for subjects in EVENT_SUBJECTS.values() for subject, owner in subjects.items()
                  if owner == role)


def event_refused(subject: str, event: events.Event) -> str | None:
    """Why an event must not be recorded as it came (None: it may): its body is not a kind its
    subject carries, or a routed one says more than its publisher may (a gateway reports only a
    failed run, a worker only a dropped request). A reference to a large event is checked for the
    kind it names here, and the event it resolves to again once read."""
    kind, on = events.event_kind(event), topology.kind_of_subject(subject)
    if isinstance(event, events.EventRef):
        kind = event.ref_kind
    if on not in EVENT_SUBJECTS.get(kind, {}):
        return f"a {kind} event on {subject!r}: events are accepted on their own kind's subjects only"
    if isinstance(event, events.EventRef):
        return None
    if on == topology.WORKER_LOST and getattr(event, "status", None) != RunStatus.ERROR:
        return f"a {topology.WORKER_LOST} event must report a failed run"
    if on == topology.DROPPED and getattr(event, "decision", None) not in (
            events.AdmissionDecision.CANCELLED, events.AdmissionDecision.TIMEOUT):
        return f"a {topology.DROPPED} event must report a cancelled or timed-out request"
    return None


def _info(*streams: str) -> list[str]:
    return [f"{_API}.STREAM.INFO.{stream}" for stream in streams]


def _read_bucket(stream: str) -> list[str]:
    """Reading a KV or Object Store bucket: last-message and direct gets, ordered consumers (which
    nats-py finds by subject: stream names)."""
    return [f"{_API}.STREAM.NAMES", f"{_API}.STREAM.MSG.GET.{stream}",
            f"{_API}.DIRECT.GET.{stream}", f"{_API}.DIRECT.GET.{stream}.>",
            f"{_API}.CONSUMER.CREATE.{stream}", f"{_API}.CONSUMER.CREATE.{stream}.>",
            f"{_API}.CONSUMER.INFO.{stream}.*", f"{_API}.CONSUMER.DELETE.{stream}.*", f"$JS.FC.{stream}.>"]


def _write_large_events() -> list[str]:
    """Putting an event too large for one message into the `helexa_events` bucket (see
    `apps.bus.event_publish.publish_event`): its chunks and meta, and the look-up and purge a put of an
    existing name makes. Its reference, on the event's own subject, names the object's digest, so
    an object another role replaced is not recorded (`apps.recorder.large_events`)."""
    return [f"{_EVENTS_OBJ_SUBJECTS}.>", *_read_bucket(_EVENTS_OBJ_STREAM),
            f"{_API}.STREAM.PURGE.{_EVENTS_OBJ_STREAM}"]


def _own_inbox(role: str, user: str | None) -> str:
    return f"{topology.inbox_prefix(role, user)}.>"


def _events(role: str) -> list[str]:
    return [topology.event_wildcard(kind) for kind in event_subject_kinds(role)]


def permissions(role: str, user: str | None) -> dict[str, Any]:
    """The nats-server `permissions` of `role`'s NATS user `user`."""
    every_stream = _info(*declaration.topology_streams())
    inbox = _own_inbox(role, user)
    if role == GATEWAY:
        publish = [
            topology.request_wildcard(), topology.cancel_wildcard(), *_events(GATEWAY),
            topology.node_endpoint_wildcard("tokenize"), topology.node_endpoint_wildcard("control"),
            # Its own reply subjects: the frame that ends a request JetStream gave up on.
            inbox,
            *every_stream, f"{_API}.STREAM.MSG.DELETE.{topology.REQUESTS_STREAM}",
            f"{_API}.CONSUMER.INFO.{topology.REQUESTS_STREAM}.*",
            *_read_bucket(_KV_STREAM),
            f"{_OBJ_SUBJECTS}.>", *_read_bucket(_OBJ_STREAM), f"{_API}.STREAM.PURGE.{_OBJ_STREAM}",
            *_write_large_events(),
            # Uploaded files (/v1/files): written, read and deleted by the gateway only.
            f"{_FILES_OBJ_SUBJECTS}.>", *_read_bucket(_FILES_OBJ_STREAM), f"{_API}.STREAM.PURGE.{_FILES_OBJ_STREAM}",
            # Batches: claims put on BATCHES and taken (with in-progress acks) by its batch runner.
            topology.BATCH_SUBJECT, f"{_API}.CONSUMER.MSG.NEXT.{topology.BATCHES_STREAM}.*",
            f"{_API}.CONSUMER.INFO.{topology.BATCHES_STREAM}.{topology.BATCH_RUNNERS_CONSUMER}",
            f"$JS.ACK.{topology.BATCHES_STREAM}.>",
        ]
        subscribe = [inbox, topology.max_deliveries_advisories()]
        return _permissions(publish, subscribe, responses=True)
    if role == WORKER:
        requests = topology.REQUESTS_STREAM
        publish = [
            # Frames and alive probes; which request's subject a worker knows is the point (see above).
            f"{topology.inbox_root(GATEWAY)}.>", *_events(WORKER),
            *every_stream,
            # Its model's consumers (interactive and batch), each filtered on one model's subject,
            # and fetching and acking through them.
            f"{_API}.CONSUMER.CREATE.{requests}.*.{topology.request_wildcard('*')}",
            f"{_API}.CONSUMER.CREATE.{requests}.*.{topology.batch_request_wildcard()}",
            f"{_API}.CONSUMER.INFO.{requests}.*", f"{_API}.CONSUMER.MSG.NEXT.{requests}.*",
            f"$JS.ACK.{requests}.>",
            f"$KV.{topology.NODES_BUCKET}.>",
            # Large requests: read, then deleted once settled (a delete marker and a purge of the chunks).
            *_read_bucket(_OBJ_STREAM), f"{_OBJ_SUBJECTS}.M.>", f"{_API}.STREAM.PURGE.{_OBJ_STREAM}",
            *_write_large_events(),
        ]
        subscribe = [inbox, topology.cancel_wildcard(), topology.node_endpoint_wildcard(), "$SRV.>"]
        deny = [topology.request_wildcard(), f"{topology.inbox_root(GATEWAY)}.>"]
        return _permissions(publish, subscribe, responses=True, deny_subscribe=deny)
    if role == RECORDER:
        stream = topology.EVENTS_STREAM
        publish = [
            *every_stream, f"{_API}.CONSUMER.CREATE.{stream}.>", f"{_API}.CONSUMER.INFO.{stream}.*",
            f"{_API}.CONSUMER.MSG.NEXT.{stream}.*", f"{_API}.CONSUMER.DELETE.{stream}.*", f"$JS.ACK.{stream}.>",
            f"{_API}.STREAM.MSG.GET.{stream}", f"{_API}.DIRECT.GET.{stream}", f"{_API}.DIRECT.GET.{stream}.>",
            # Trimming what it recorded, erasing a deleted response's event and large events' objects.
            f"{_API}.STREAM.PURGE.{stream}", f"{_API}.STREAM.MSG.DELETE.{stream}",
            *_read_bucket(_EVENTS_OBJ_STREAM), f"{_EVENTS_OBJ_SUBJECTS}.M.>",
            f"{_API}.STREAM.PURGE.{_EVENTS_OBJ_STREAM}",
        ]
        return _permissions(publish, [inbox])
    if role == BENCH:
        return _permissions([*_events(BENCH), *every_stream, *_write_large_events()], [inbox])
    if role == OPERATOR:
        publish = [
            topology.node_endpoint_wildcard(), "$SRV.>",
            f"{_API}.INFO", f"{_API}.STREAM.NAMES", f"{_API}.STREAM.LIST", f"{_API}.STREAM.INFO.*",
            f"{_API}.CONSUMER.NAMES.*", f"{_API}.CONSUMER.LIST.*", f"{_API}.CONSUMER.INFO.*.*",
            f"{_API}.STREAM.MSG.GET.*", f"{_API}.DIRECT.GET.>",
            # Reading EVENTS, the node registry and large requests through ordered consumers of its own.
            *_read_bucket(topology.EVENTS_STREAM), *_read_bucket(_KV_STREAM), *_read_bucket(_OBJ_STREAM),
            *_read_bucket(_EVENTS_OBJ_STREAM),
        ]
        return _permissions(publish, [">"])
    raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")


def _permissions(publish: list[str], subscribe: list[str], *, responses: bool = False,
                 deny_subscribe: list[str] | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}}
    if deny_subscribe:
        found["subscribe"]["deny"] = deny_subscribe
    if responses:
        # Answers to requests it was sent (alive probes, its endpoints), to any reply subject.
        found["allow_responses"] = True
    return found


def authorization(admin: tuple[str, str], users: list[tuple[str, str, str]]) -> str:
    """A nats-server `authorization` block: the administrator (`(user, password)`, no limits) and
    the users of the roles (`(role, user, password)`; a role may have several, e.g. one per
    gateway). Passwords are written as given."""
    entries: list[dict[str, Any]] = [{"user": admin[0], "password": admin[1]}]
    entries += [{"user": user, "password": password, "permissions": permissions(role, user)}
                for role, user, password in users]
    # nats-server's configuration format reads JSON.
    lines = ",\n    ".join(json.dumps(entry) for entry in entries)
    return f"authorization {{\n  users: [\n    {lines}\n  ]\n}}"
