"""The engine's settings as one object: checked in one dialect, batch_tokens resolved once,
embedded in the command line's options."""

import dataclasses

import pytest

from dsv4enc.engine.defaults import DEFAULT_BATCH_TOKENS
from dsv4enc.engine.settings import SETTINGS, EngineSettings
from dsv4enc.errors import SettingsError, UsageError
from dsv4enc.run.options import EncodeOptions, validate


def test_settings_are_frozen_and_checked_in_one_dialect():
    settings = EngineSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.features = "vit"  # type: ignore[misc]
    for bad in (EngineSettings(features="cls"), EngineSettings(batch_tokens=0),
                EngineSettings(max_images=-1), EngineSettings(transform="gpu")):
        with pytest.raises(SettingsError) as caught:
            bad.check()
        # the command line prints it as one usage line; the API's callers catch a ValueError
        assert isinstance(caught.value, UsageError) and isinstance(caught.value, ValueError)


def test_batch_tokens_default_resolved_once_by_device_kind():
    assert EngineSettings().for_device("cpu").batch_tokens == DEFAULT_BATCH_TOKENS["cpu"]
    assert EngineSettings().for_device("cuda").batch_tokens == DEFAULT_BATCH_TOKENS["cuda"]
    given = EngineSettings(batch_tokens=700)
    assert given.for_device("cuda") is given


def test_encode_options_embed_the_settings():
    opts = EncodeOptions(inputs=["x"], out="o.parquet", features="vit", batch_tokens=512)
    assert opts.engine == EngineSettings(features="vit", batch_tokens=512)
    assert not any(hasattr(opts, name) for name in SETTINGS)
    again = dataclasses.replace(opts, deterministic=False)
    assert again.engine == EngineSettings(features="vit", batch_tokens=512, deterministic=False)
    with pytest.raises(TypeError, match="no option"):
        EncodeOptions(inputs=["x"], out="o.parquet", bogus=1)


def test_validate_reads_the_engine_settings():
    base = dict(inputs=["x"], out="o.parquet", random_init=True, config="c.json")
    with pytest.raises(SettingsError, match="--features must be one of aligner, vit"):
        validate(EncodeOptions(**base, features="cls"))
    with pytest.raises(SettingsError, match="--batch-tokens must be positive, got 0"):
        validate(EncodeOptions(**base, batch_tokens=0))


def test_a_setting_with_help_is_an_encode_option():
    from dsv4enc.cli import settings_options

    assert settings_options() == {}  # every setting's option is written out in cli.py

    @dataclasses.dataclass(frozen=True)
    class Grown(EngineSettings):
        pinned: bool = dataclasses.field(default=True, metadata={"help": "Stage in pinned memory."})

    (name, (kind, option)), = settings_options(Grown).items()
    assert (name, kind, option.default) == ("pinned", bool, True)
    assert option.param_decls == ("--pinned/--no-pinned",) and option.help.startswith("Stage")


def test_the_api_takes_the_settings_as_one_object(tiny_cfg):
    from dsv4enc.api import Encoder

    settings = EngineSettings(features="vit", batch_tokens=512, max_images=2)
    enc = Encoder.from_config(tiny_cfg, device="cpu", dtype="float32", settings=settings)
    assert enc.settings == settings and (enc.features, enc.batch_tokens) == ("vit", 512)
    with pytest.raises(SettingsError, match="not both"):
        Encoder.from_config(tiny_cfg, device="cpu", dtype="float32", settings=settings,
                            features="vit")
