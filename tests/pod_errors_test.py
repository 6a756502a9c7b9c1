"""Cloud TPU's errors told apart (``jobs/pod_errors.py``), from the texts gcloud and the
TPU API give: no capacity and code 13 retried, a rate limit retried, a quota fatal with
its message, ALREADY_EXISTS waited for, credentials and roles stopped with the fix."""

import dataclasses

import pytest

from magic_jax.jobs.pod_errors import Create, Kind, Then, after_create, classify, error_line

CREATE = "ERROR: (gcloud.compute.tpus.tpu-vm.create) "
NO_CAPACITY = CREATE + (
    '{\n  "code": 8,\n  "message": "There is no more capacity in the zone \\"us-east5-a\\"; you'
    " can try in another zone where Cloud TPU Nodes are offered (see"
    ' https://cloud.google.com/tpu/docs/regions) [EID: 0x1bc8f9d790be9142]"\n}\n'
)
INTERNAL = CREATE + '{\n  "code": 13,\n  "message": "An internal error has occurred."\n}\n'
# an operation's error, as Terraform shows the same LRO
INTERNAL_OP = (
    "Error waiting for Creating Vm: Error code 13, message: an internal error has occurred"
)


def _http_429(message):
    url = "https://tpu.googleapis.com/v2/projects/p/locations/us-east5-a/nodes?alt=json"
    return (
        f"{CREATE}HttpError accessing <{url}&nodeId=magic-jax>: response: <{{'status': 429}}>,"
        f' content <{{\n  "error": {{\n    "code": 429,\n    "message": "{message}",\n'
        '    "status": "RESOURCE_EXHAUSTED"\n  }\n}\n>\nThis may be due to network'
        " connectivity issues. Please check your network settings, and the status of the"
        " service you are trying to reach.\n"
    )


RATE = _http_429(
    "Quota exceeded for quota metric 'Requests' and limit 'Requests per minute' of service"
    " 'tpu.googleapis.com' for consumer 'project_number:123456789'."
)
RATE_REGIONAL = _http_429(
    "Quota exceeded for quota metric 'Read requests' and limit 'ReadPerMinutePerProjectRegion'"
    " of service 'tpu.googleapis.com' for consumer 'project_number:123456789'."
)
QUOTA = _http_429(
    "Quota limit 'TPUV5pPreemptiblePodPerProjectPerZoneForTPUAPI' has been exceeded. Limit: 0"
    " in zone us-east5-a."
)
QUOTA_CODE_8 = CREATE + (
    '{\n  "code": 8,\n  "message": "Quota limit \'TPUV5sLitepodServingPerProjectPerZoneForTPUAPI\''
    ' has been exceeded. Limit: 16 in zone us-west4-a."\n}\n'
)
EXISTS = (
    CREATE + "ALREADY_EXISTS: Resource 'projects/p/locations/us-east5-a/nodes/magic-jax'"
    " already exists\n"
)
NOT_FOUND = (  # with the account gcloud names since it says which one asked
    "ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource"
    " 'projects/p/locations/us-east5-a/nodes/magic-jax' was not found. This command is"
    " authenticated as run@p.iam.gserviceaccount.com which is the active account specified"
    " by the [core/account] property\n- '@type': type.googleapis.com/google.rpc.ResourceInfo\n"
    "  resourceName: projects/p/locations/us-east5-a/nodes/magic-jax\n"
)
REAUTH = (
    "ERROR: (gcloud.compute.tpus.tpu-vm.describe) There was a problem refreshing your current"
    " auth tokens: Reauthentication failed. cannot prompt during non-interactive execution.\n"
    "Please run:\n\n  $ gcloud auth login\n\nto obtain new credentials.\n"
)
NO_ACCOUNT = (
    "ERROR: (gcloud.compute.tpus.tpu-vm.describe) You do not currently have an active account"
    " selected.\nPlease run:\n\n  $ gcloud auth login\n"
)
DENIED = (
    CREATE + "PERMISSION_DENIED: Permission 'tpu.nodes.create' denied on"
    " 'projects/p/locations/us-east5-a/nodes/magic-jax'\n"
)
ACT_AS = (
    CREATE + "PERMISSION_DENIED: Permission 'iam.serviceAccounts.actAs' denied on service"
    " account run@p.iam.gserviceaccount.com (or it may not exist).\n"
)
DISABLED = (
    "ERROR: (gcloud.compute.tpus.tpu-vm.create) PERMISSION_DENIED: Cloud TPU API has not been"
    " used in project 123456789 before or it is disabled. Enable it by visiting"
    " https://console.developers.google.com/apis/api/tpu.googleapis.com/overview?project="
    "123456789 then retry.\n"
)
STORAGE = (
    "ERROR: (gcloud.storage.cp) [run@p.iam.gserviceaccount.com] does not have"
    " storage.objects.create access to the Google Cloud Storage object.\n"
)


@pytest.mark.parametrize(
    "text, kind",
    [
        (NO_CAPACITY, Kind.CAPACITY),
        (INTERNAL, Kind.CAPACITY),
        (INTERNAL_OP, Kind.CAPACITY),
        (RATE, Kind.RATE_LIMIT),
        (RATE_REGIONAL, Kind.RATE_LIMIT),
        (QUOTA, Kind.QUOTA),
        (QUOTA_CODE_8, Kind.QUOTA),
        (EXISTS, Kind.EXISTS),
        (NOT_FOUND, Kind.NOT_FOUND),
        (REAUTH, Kind.AUTH),
        (NO_ACCOUNT, Kind.AUTH),
        (DENIED, Kind.PERMISSION),
        (ACT_AS, Kind.PERMISSION),
        (DISABLED, Kind.PERMISSION),
        (STORAGE, Kind.PERMISSION),
        (CREATE + "INVALID_ARGUMENT: Invalid value for field 'acceleratorType'", Kind.OTHER),
    ],
)
def test_each_error_as_gcloud_words_it(text, kind):
    error = classify(text)
    assert error.kind is kind
    assert error.retried == (kind in (Kind.CAPACITY, Kind.RATE_LIMIT))


def test_the_line_shown_is_the_apis_message():
    assert error_line(NO_CAPACITY).startswith('There is no more capacity in the zone "us-east5-a"')
    assert classify(QUOTA).say() == (
        "Quota limit 'TPUV5pPreemptiblePodPerProjectPerZoneForTPUAPI' has been exceeded."
        " Limit: 0 in zone us-east5-a."
    )
    assert classify(EXISTS).line.startswith("ERROR: (gcloud.compute.tpus.tpu-vm.create) ALREADY")


@pytest.mark.parametrize(
    "text, fix",
    [
        (REAUTH, "gcloud auth login"),
        (NO_ACCOUNT, "gcloud auth login"),
        (DENIED, "the permission tpu.nodes.create is missing: grant the caller roles/tpu.admin"),
        (ACT_AS, "grant the caller roles/iam.serviceAccountUser"),
        (STORAGE, "storage.objects.create is missing: grant the caller roles/storage.objectUser"),
        (DISABLED, "`gcloud services enable tpu.googleapis.com`"),
    ],
)
def test_auth_and_permission_errors_name_the_fix(text, fix):
    said = classify(text).say()
    assert fix in said and "\n" not in said


def _create(**changes):
    return dataclasses.replace(
        Create(name="t", accelerator="v5p-64", zone="us-east5-a", tries=3), **changes
    )


@pytest.mark.parametrize(
    "text, create, then",
    [
        (NO_CAPACITY, _create(), Then.RETRY),
        (INTERNAL, _create(try_=2), Then.RETRY),
        (RATE, _create(), Then.RETRY),
        (NO_CAPACITY, _create(try_=3), Then.STOP),  # the tries used up
        (QUOTA, _create(), Then.STOP),
        (QUOTA_CODE_8, _create(), Then.STOP),
        (EXISTS, _create(), Then.AWAIT_GONE),  # a delete under way: not a try
        (EXISTS, _create(queued="t-qr"), Then.ATTACH),  # a request already queued
        (REAUTH, _create(), Then.STOP),
        (DENIED, _create(), Then.STOP),
        (NOT_FOUND, _create(), Then.STOP),
    ],
)
def test_what_follows_a_failed_create(text, create, then):
    assert after_create(classify(text), create).then is then


def test_a_retry_backs_off_twice_as_long_up_to_the_longest_wait():
    first = after_create(classify(RATE), _create(wait_s=60, max_wait_s=100))
    assert (first.wait_s, first.next_wait_s) == (60, 100)
    assert first.line.startswith("rate-limited (try 1 of 3): Quota exceeded for quota metric")
    assert first.line.endswith("; trying again in 1m00s")
    late = after_create(classify(INTERNAL), _create(try_=2, wait_s=3700))
    assert late.line == (
        "no capacity for v5p-64 in us-east5-a (try 2 of 3): An internal error has occurred.;"
        " trying again in 1h01m"
    )


def test_a_fatal_create_says_why_in_one_line():
    assert after_create(classify(QUOTA), _create()).line == (
        "creating t failed: out of quota, which no retry can fix: Quota limit"
        " 'TPUV5pPreemptiblePodPerProjectPerZoneForTPUAPI' has been exceeded. Limit: 0 in zone"
        " us-east5-a."
    )
    line = after_create(classify(NO_CAPACITY), _create(try_=3)).line
    assert line.startswith("no capacity for v5p-64 in us-east5-a after 3 tries (--create-tries 3)")
    assert "grant the caller roles/tpu.admin" in after_create(classify(DENIED), _create()).line


@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        ("INTERNAL", "An internal error has occurred.", Kind.CAPACITY),  # code 13
        ("RESOURCE_EXHAUSTED", "There is no more capacity in the zone", Kind.CAPACITY),
        ("RESOURCE_EXHAUSTED", "Quota exceeded for quota metric 'Requests' and limit"
         " 'Requests per minute' of service 'tpu.googleapis.com'", Kind.RATE_LIMIT),
        ("RESOURCE_EXHAUSTED", "Too many requests. [RATE_LIMIT_EXCEEDED]", Kind.RATE_LIMIT),
        ("RESOURCE_EXHAUSTED", "Quota limit 'TPUV5pPreemptiblePodPerProjectPerZoneForTPUAPI'"
         " has been exceeded. Limit: 0 in zone us-east5-a.", Kind.QUOTA),
        ("ALREADY_EXISTS", "Resource 'projects/p/locations/z/nodes/n' already exists", Kind.EXISTS),
        ("NOT_FOUND", "Resource 'projects/p/locations/z/nodes/n' was not found", Kind.NOT_FOUND),
        ("UNAUTHENTICATED", "Request had invalid authentication credentials.", Kind.AUTH),
        ("PERMISSION_DENIED", "Permission 'tpu.nodes.get' denied on 'n'", Kind.PERMISSION),
        ("INVALID_ARGUMENT", "Invalid value for field 'node.accelerator_type'", Kind.OTHER),
    ],
)  # fmt: skip
def test_an_api_status_is_told_apart_by_its_code_then_its_words(status, message, kind):
    from magic_jax.jobs.pod_errors import from_status

    error = from_status(status, message)
    assert error.kind is kind and error.line == message


def test_a_disabled_api_and_a_missing_role_name_their_fix():
    from magic_jax.jobs.pod_errors import from_status

    off = "Cloud TPU API has not been used in project 123 before or it is disabled."
    assert "gcloud services enable tpu.googleapis.com" in from_status("PERMISSION_DENIED", off).fix
    role = from_status("PERMISSION_DENIED", "Permission 'iam.serviceAccounts.actAs' denied on sa")
    assert "roles/iam.serviceAccountUser" in role.fix


def test_an_error_told_apart_already_is_read_back_as_it_is():
    from magic_jax.jobs.pod_errors import from_status, told

    error = from_status("RESOURCE_EXHAUSTED", "Quota limit 'X' has been exceeded.")
    text = "a traceback line\n" + told(error) + "\n"
    assert classify(text) == error  # not classified again from its words
