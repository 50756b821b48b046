"""toolconfig: what of the user's tool configuration reaches a cell's HOME (pure)."""
from agnsup import toolconfig


def test_a_url_with_a_user_or_password_holds_credentials():
    assert toolconfig.holds_credentials("https://u:p@h/simple")
    assert toolconfig.holds_credentials("file:///x https://tok@h/")
    assert not toolconfig.holds_credentials("https://h/simple/@scope")
    assert not toolconfig.holds_credentials("file:///opt/pypi/simple")


def test_npm_keeps_registries_and_drops_every_auth_line(tmp_path):
    (tmp_path / ".npmrc").write_text("registry=https://r.example/\n@co:registry=https://co.example/\n"
                                     "//r.example/:_authToken=abc\n_auth=xyz\nemail=a@b\n"
                                     "@x:registry=https://u:p@x.example/\n")
    text, taken, dropped = toolconfig.npm_file(str(tmp_path))
    assert text == "registry=https://r.example/\n@co:registry=https://co.example/\n"
    assert taken == ["registry", "@co:registry"]
    assert dropped == ["//r.example/:...", "_auth", "email", "@x:registry"]


def test_pip_keeps_index_keys_and_a_later_file_wins(tmp_path):
    (tmp_path / ".pip").mkdir()
    (tmp_path / ".pip" / "pip.conf").write_text("[global]\nindex-url = https://old/\n")
    (tmp_path / ".config" / "pip").mkdir(parents=True)
    (tmp_path / ".config" / "pip" / "pip.conf").write_text(
        "[global]\nindex-url = https://new/\nextra-index-url =\n    https://a/\n    https://b/\n"
        "[install]\nuser-password = x\n")
    text, taken, dropped = toolconfig.pip_file(str(tmp_path))
    assert text == "[global]\nindex-url = https://new/\nextra-index-url = https://a/ https://b/\n"
    assert dropped == ["install.user-password"]


def test_env_keys_pass_only_for_listed_tools_and_without_credentials():
    env = {"PIP_INDEX_URL": "https://h/", "PIP_EXTRA_INDEX_URL": "https://u:p@h/", "NPM_CONFIG_REGISTRY": "https://n/",
           "PIP_CERT_PASSWORD": "x"}
    assert toolconfig.host_env(("pip",), env) == ({"PIP_INDEX_URL": "https://h/"}, ["PIP_EXTRA_INDEX_URL"])
    assert toolconfig.host_env((), env) == ({}, [])


def test_pip_drops_a_path_in_the_hidden_home_unless_the_cell_sees_it(tmp_path):
    (tmp_path / ".config" / "pip").mkdir(parents=True)
    (tmp_path / ".config" / "pip" / "pip.conf").write_text(
        f"[global]\nfind-links = {tmp_path}/wheels\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    text, taken, dropped = toolconfig.pip_file(str(tmp_path))
    assert text == "[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n"
    assert dropped == ["global.find-links (names a path in the hidden home; list it in filesystem.home_allow)"]
    text, _, dropped = toolconfig.pip_file(str(tmp_path), shown=lambda p: p.startswith(f"{tmp_path}/wheels"))
    assert f"find-links = {tmp_path}/wheels" in text and not dropped
