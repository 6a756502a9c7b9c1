"""Cloud TPU's errors told apart, as gcloud and the TPU API word them: what is retried
(no capacity, an internal error, a rate limit), what is waited for (a resource that
still exists), what ends a pod run at once (quota, credentials, a missing role, any
other error), and the one line the user sees. Pure: text or a status in, verdict out.

``from_status`` tells apart an error of the API as its client gives it (a google.rpc
status and message: a call's, an operation's ``error``, a queued resource's
``failedData``; ``jobs/tpu_api.py``); ``classify`` the texts gcloud prints
(``ERROR: (gcloud...) ...`` with the API's JSON error, or an ``HttpError accessing <...>``),
and reads back an error ``told`` already as it is. Both share the kinds, the words that
split RESOURCE_EXHAUSTED (a rate limit, a quota, no capacity) and the fixes.
"""

from __future__ import annotations

import dataclasses
import enum
import re


class Kind(enum.Enum):
    """What an error is, and so what a supervisor does with it."""

    CAPACITY = "capacity"  # no capacity, or code 13 (how Spot stockouts come too): retried
    RATE_LIMIT = "rate-limit"  # a per-minute request quota (HTTP 429): retried
    QUOTA = "quota"  # a resource quota exhausted: no retry mends it
    EXISTS = "exists"  # ALREADY_EXISTS (a delete still under way): wait, then again
    NOT_FOUND = "not-found"  # the resource is gone
    AUTH = "auth"  # credentials expired or missing
    PERMISSION = "permission"  # a role missing, or the API not enabled
    OTHER = "other"  # anything else: fatal


RETRIED = frozenset({Kind.CAPACITY, Kind.RATE_LIMIT})

# gcloud's and the API's words, checked in this order (a rate limit and a quota are both
# RESOURCE_EXHAUSTED / 429; a quota is also "code": 8 as no capacity is)
_PATTERNS = (
    (
        Kind.AUTH,
        r"Reauthentication failed|refreshing your current auth tokens|gcloud auth login"
        r"|invalid_grant|UNAUTHENTICATED|invalid authentication credentials"
        r"|do not currently have an active account|DefaultCredentialsError",
    ),
    (
        Kind.PERMISSION,
        r"PERMISSION_DENIED|Permission '[^']+' denied|does not have [\w.]+ access"
        r"|SERVICE_DISABLED|has not been used in project|\bis disabled\b",
    ),
    (
        Kind.RATE_LIMIT,
        r"RATE_LIMIT_EXCEEDED|rateLimitExceeded|[Tt]oo [Mm]any [Rr]equests"
        r"|limit '[^']*[Pp]er ?(?:[Mm]inute|100 ?[Ss]econds|[Ss]econd|[Dd]ay)[^']*'",
    ),
    (Kind.QUOTA, r"[Qq]uota|QUOTA_EXCEEDED"),
    (
        Kind.CAPACITY,
        r"no more capacity|ZONE_RESOURCE_POOL_EXHAUSTED|[Ii]nsufficient (?:reserved )?capacity"
        r"|[Ss]tockout|\"code\": *8,|RESOURCE_EXHAUSTED|\"code\": *13,|[Ee]rror code 13"
        r"|an internal error has occurred|\bINTERNAL\b",
    ),
    (Kind.EXISTS, r"ALREADY_EXISTS|already exists"),
    (Kind.NOT_FOUND, r"NOT_FOUND|was not found"),
)
# the role that grants a permission, by its service
_ROLES = (
    ("tpu.", "roles/tpu.admin"),
    ("storage.", "roles/storage.objectUser"),
    ("iam.serviceAccounts.actAs", "roles/iam.serviceAccountUser"),
    ("compute.", "roles/compute.osAdminLogin"),
)


@dataclasses.dataclass(frozen=True)
class TpuError:
    """An error told apart.

    Attributes:
      kind: what it is.
      line: the line that says what went wrong (the API's message, else gcloud's last
        ERROR line, else its last line), at most 300 characters.
      fix: for ``AUTH`` and ``PERMISSION``, the command or role that fixes it.
    """

    kind: Kind
    line: str
    fix: str = ""

    @property
    def retried(self) -> bool:
        return self.kind in RETRIED

    def say(self) -> str:
        """One line: what went wrong, then the fix where there is one."""
        return f"{self.line} ({self.fix})" if self.fix else self.line


def error_line(text: str) -> str:
    """The line of an error output that says what went wrong."""
    messages = re.findall(r"""["']message["']: *["'](.*?)["'],?\s*$""", text, re.M)
    if messages:
        line = messages[-1]
    else:
        errors = [x for x in text.splitlines() if re.search(r"ERROR|[Ee]rror", x)]
        rest = [x for x in text.splitlines() if x.strip()]
        line = (errors or rest or [""])[-1]
    return line.replace('\\"', '"').strip()[:300]


def _fix(kind: Kind, text: str) -> str:
    if kind is Kind.AUTH:
        return "run `gcloud auth login` and `gcloud auth application-default login`"
    if kind is not Kind.PERMISSION:
        return ""
    service = re.search(r"([a-z]+\.googleapis\.com)", text)
    if re.search(r"SERVICE_DISABLED|has not been used in project|\bis disabled\b", text):
        api = service.group(1) if service else "tpu.googleapis.com"
        return f"enable the API: `gcloud services enable {api}`"
    found = re.search(r"Permission '([^']+)'|does not have ([\w.]+) access", text)
    permission = next((g for g in found.groups() if g), "") if found else ""
    role = next((r for p, r in _ROLES if permission.startswith(p)), "roles/tpu.admin")
    what = f"the permission {permission}" if permission else "a permission"
    return f"{what} is missing: grant the caller {role}"


def classify(text: str) -> TpuError:
    """The kind of error that ``text`` (gcloud's error output, or an API error) is."""
    for line in text.splitlines():  # one the TPU API's command told apart already
        if line.startswith(TOLD + "\t"):
            _, kind_, said, fix = [*line.split("\t"), "", "", ""][:4]
            return TpuError(Kind(kind_), said, fix)
    kind = next((k for k, p in _PATTERNS if re.search(p, text)), Kind.OTHER)
    return TpuError(kind, error_line(text) or "no error message", _fix(kind, text))


# google.rpc.Code: each number's name (the API's operations and failedData carry numbers)
RPC_CODES = {
    0: "OK",
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    16: "UNAUTHENTICATED",
}
# an API error's kind by its status; RESOURCE_EXHAUSTED is a rate limit, a quota or no
# capacity, as its message says
_STATUS_KINDS = {
    "UNAUTHENTICATED": Kind.AUTH,
    "PERMISSION_DENIED": Kind.PERMISSION,
    "ALREADY_EXISTS": Kind.EXISTS,
    "NOT_FOUND": Kind.NOT_FOUND,
    "INTERNAL": Kind.CAPACITY,  # how Spot stockouts also come
    "UNAVAILABLE": Kind.CAPACITY,  # the service, briefly: retried as no capacity is
}
# What the TPU API's command (``jobs/tpu_cli.py``) prints for an error it told apart:
# ``tpu-api-error<TAB>KIND<TAB>LINE``; ``classify`` takes it as it is.
TOLD = "tpu-api-error"


def from_status(status: str, message: str) -> TpuError:
    """An error of the Cloud TPU API (a call's, an operation's, a queued resource's
    ``failedData``) told apart by its google.rpc status and message.

    Args:
      status: the status by name (``RESOURCE_EXHAUSTED``; ``RPC_CODES`` names numbers).
      message: the API's message.

    Returns:
      The error, its line the message (as gcloud shows it).
    """
    kind = _STATUS_KINDS.get(status, Kind.OTHER)
    if status == "RESOURCE_EXHAUSTED":
        limits = (Kind.RATE_LIMIT, Kind.QUOTA)
        kind = next((k for k, p in _PATTERNS if k in limits and re.search(p, message)), kind)
        kind = Kind.CAPACITY if kind is Kind.OTHER else kind
    line = " ".join(message.split())[:300] or status
    return TpuError(kind, line, _fix(kind, f"{status}: {message}"))


def told(error: TpuError) -> str:
    """``error`` as one line ``classify`` reads back as it is (``TOLD``)."""
    return "\t".join((TOLD, error.kind.value, error.line, error.fix))


def span(seconds: int) -> str:
    """Seconds as ``45s``, ``12m05s``, ``3h07m``."""
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Then(enum.Enum):
    """What a pod launch does after a create that failed."""

    ATTACH = "attach"  # the queued request exists already: wait for it
    AWAIT_GONE = "await-gone"  # the node exists still (a delete under way): wait, then again
    RETRY = "retry"  # after ``CreateFailed.wait_s``
    STOP = "stop"  # exit 1 with the line


@dataclasses.dataclass(frozen=True, kw_only=True)
class Create:
    """A create of a slice (or its queued request) and its tries so far.

    Attributes:
      name: the node's name.
      queued: the request's name when it is a queued resource, else ``""``.
      accelerator: the accelerator type (``v5p-64``).
      zone: the zone.
      try_: this try's number, from 1.
      tries: how many are allowed (``--create-tries``).
      wait_s: the wait before the next try.
      max_wait_s: the longest wait between tries.
    """

    name: str
    queued: str = ""
    accelerator: str
    zone: str
    try_: int = 1
    tries: int = 12
    wait_s: int = 60
    max_wait_s: int = 1800


@dataclasses.dataclass(frozen=True, kw_only=True)
class CreateFailed:
    """What follows a failed create: the step, the line the user sees, and for a retry
    the wait before it and the one after (twice as long, at most the longest)."""

    then: Then
    line: str
    wait_s: int = 0
    next_wait_s: int = 0


def after_create(error: TpuError, create: Create) -> CreateFailed:
    """What follows a create that failed with ``error``: no capacity (code 8, or 13 as
    Spot stockouts also come) and rate limits are tried again with exponential backoff
    while tries are left; ALREADY_EXISTS is waited for (a delete under way) or, for a
    queued request, attached to; quota, credentials, a missing role and anything else
    end the launch with the API's message and the fix.

    Args:
      error: the create's error, told apart.
      create: the create and its tries so far.

    Returns:
      The next step and the line the user sees.
    """
    c = create
    if error.kind is Kind.EXISTS and c.queued:  # an earlier launch's, still queued
        line = f"queued resource {c.queued} exists already: waiting for it"
        return CreateFailed(then=Then.ATTACH, line=line)
    if error.kind is Kind.EXISTS:
        line = f"{c.name} exists still (an earlier delete under way): waiting for it to go"
        return CreateFailed(then=Then.AWAIT_GONE, line=line)
    if error.kind is Kind.QUOTA:
        line = f"creating {c.name} failed: out of quota, which no retry can fix: {error.say()}"
        return CreateFailed(then=Then.STOP, line=line)
    if not error.retried:
        return CreateFailed(then=Then.STOP, line=f"creating {c.name} failed: {error.say()}")
    no_capacity = f"no capacity for {c.accelerator} in {c.zone}"
    if c.try_ >= c.tries:
        line = f"{no_capacity} after {c.try_} tries (--create-tries {c.tries}): {error.say()}"
        return CreateFailed(then=Then.STOP, line=line)
    what = "rate-limited" if error.kind is Kind.RATE_LIMIT else no_capacity
    line = f"{what} (try {c.try_} of {c.tries}): {error.say()}; trying again in {span(c.wait_s)}"
    next_wait = min(c.wait_s * 2, c.max_wait_s)
    return CreateFailed(then=Then.RETRY, line=line, wait_s=c.wait_s, next_wait_s=next_wait)
