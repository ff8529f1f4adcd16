import pytest
from fsspec.implementations.local import LocalFileSystem

from sluice.storage.urls import ALLOWED_FORMS, open_url, redact


@pytest.fixture
def s3_env(monkeypatch):
    for name in ("SLUICE_S3_ENDPOINT", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k-from-env")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s-from-env")
    return monkeypatch


def test_file_urls_and_plain_paths_open_the_local_filesystem(tmp_path, monkeypatch):
    fs, root = open_url(f"file://{tmp_path}")
    assert isinstance(fs, LocalFileSystem)
    assert root == str(tmp_path)
    assert open_url(str(tmp_path))[1] == str(tmp_path)
    assert open_url(f"file://localhost{tmp_path}")[1] == str(tmp_path)
    monkeypatch.chdir(tmp_path)
    fs, root = open_url("runs/x")
    assert isinstance(fs, LocalFileSystem)
    assert root == str(tmp_path / "runs" / "x")


def test_s3_takes_credentials_and_endpoint_from_the_environment(s3_env):
    s3_env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    fs, root = open_url("s3://my-bucket/some/prefix/")
    assert root == "my-bucket/some/prefix"
    assert (fs.key, fs.secret, fs.endpoint_url) == (
        "k-from-env",
        "s-from-env",
        "http://127.0.0.1:1",
    )
    s3_env.setenv("SLUICE_S3_ENDPOINT", "http://127.0.0.1:2")
    fs, root = open_url("s3://my-bucket")
    assert root == "my-bucket"
    assert fs.endpoint_url == "http://127.0.0.1:2"


def test_s3_without_credentials_in_the_environment_is_refused(s3_env):
    s3_env.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ValueError, match="AWS_SECRET_ACCESS_KEY"):
        open_url("s3://my-bucket/x")


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://example.com/x", "unsupported scheme"),
        ("gs://bucket/x", "unsupported scheme"),
        ("s3://", "no bucket"),
        ("s3:///prefix", "no bucket"),
        ("s3://ab/x", "invalid bucket name"),
        ("s3://Bad_Bucket/x", "invalid bucket name"),
        ("s3://bucket/a/../b", "'.' and '..'"),
        ("file://somehost/path", "absolute path"),
        ("", "empty URL"),
    ],
)
def test_bad_urls_name_the_url_and_the_allowed_forms(s3_env, url, why):
    with pytest.raises(ValueError, match=why) as info:
        open_url(url)
    assert repr(url) in str(info.value)
    assert ALLOWED_FORMS in str(info.value)


def test_credentials_in_a_url_are_refused_and_never_echoed(s3_env):
    with pytest.raises(ValueError, match="credentials in the URL") as info:
        open_url("s3://user:hunter2@my-bucket/x")
    assert "hunter2" not in str(info.value)


def test_redact_strips_user_and_password():
    assert redact("s3://user:hunter2@my-bucket/x") == "s3://***@my-bucket/x"
    assert redact("http://u@host:9000/a?b=1") == "http://***@host:9000/a?b=1"
    assert redact("s3://my-bucket/x") == "s3://my-bucket/x"
    assert redact("/plain/path") == "/plain/path"
