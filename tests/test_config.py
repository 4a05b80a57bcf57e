import pytest

from lab_utils.engine import config
from lab_utils.learn.errors import LabError


def test_env_overrides_auto(monkeypatch):
    monkeypatch.setenv("LAB_PROFILE", "full")
    assert config.resolve_profile_name(None) == ("full", "set by $LAB_PROFILE=full")
    assert config.get_profile().train_images is None  # full = all of CIFAR-10


def test_explicit_beats_env(monkeypatch):
    monkeypatch.setenv("LAB_PROFILE", "full")
    assert config.resolve_profile_name("quick")[0] == "quick"


def test_auto_without_cuda_is_quick(monkeypatch):
    monkeypatch.delenv("LAB_PROFILE", raising=False)
    monkeypatch.setattr(config, "cuda_available", lambda: False)
    name, why = config.resolve_profile_name(None)
    assert name == "quick" and "no CUDA" in why
    monkeypatch.setattr(config, "cuda_available", lambda: True)
    assert config.resolve_profile_name("auto")[0] == "full"


@pytest.mark.parametrize("bad", ["fast", "QUICK", ""])
def test_unknown_profile_names_valid_ones(bad, monkeypatch):
    monkeypatch.delenv("LAB_PROFILE", raising=False)
    if bad == "":
        # an empty env var means "not set"
        monkeypatch.setenv("LAB_PROFILE", "")
        monkeypatch.setattr(config, "cuda_available", lambda: False)
        assert config.resolve_profile_name(None)[0] == "quick"
        return
    with pytest.raises(LabError, match="use one of: full, quick"):
        config.get_profile(bad)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "32", True, None])
def test_batch_size_must_be_positive_int(bad):
    with pytest.raises(LabError, match="batch size must be a whole number of at least 1"):
        config.check_batch_size(bad)


def test_batch_sizes_list():
    assert config.check_batch_sizes([32, 128]) == (32, 128)
    with pytest.raises(LabError):
        config.check_batch_sizes([])
    with pytest.raises(LabError):
        config.check_batch_sizes(32)


def test_paths_follow_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path / "r"))
    assert config.results_dir("quick") == (tmp_path / "r" / "quick").resolve()
    assert (config.labs_dir() / "00_environment.ipynb").exists()


def test_check_choice_names_the_valid_values():
    assert config.check_choice("cosine", ("constant", "cosine"), "decay") == "cosine"
    with pytest.raises(LabError, match=r"Unknown decay 'linear'; use one of: constant, cosine\."):
        config.check_choice("linear", ("constant", "cosine"), "decay")
