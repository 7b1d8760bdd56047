# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project

from contextlib import nullcontext
from types import SimpleNamespace
from unittest.mock import Mock, patch

import pytest
import torch
import torch.nn as nn
from transformers import PreTrainedConfig

from vllm.config import ParallelConfig
from vllm.multimodal.processing import InputProcessingContext


# Helper function to print input IDs with coalesced audio/video tokens.
def print_input_ids(input_ids):
    """Print input IDs, compressing consecutive special tokens.
    - 151675: <|audio_pad|>
    - 151656: <|video_pad|>
    """
    if not input_ids:
        print("[]")
        return

    result = []
    i = 0

    while i < len(input_ids):
        current_id = input_ids[i]

        # Check if it's a special token that should be compressed
        if current_id in [151675, 151656]:
            # Count consecutive occurrences
            count = 1
            while i + count < len(input_ids) and input_ids[i + count] == current_id:
                count += 1

            # Add compressed representation
            token_name = "<|audio_pad|>" if current_id == 151675 else "<|video_pad|>"
            result.append(f"{token_name} * {count}")
            i += count
        else:
            # Regular token, just add it
            result.append(str(current_id))
            i += 1

    print(", ".join(result))


@pytest.fixture
def mock_qwen3_omni_config():
    """Create a mock Qwen3OmniMoeThinker config."""
    config = Mock(spec=PreTrainedConfig)
    # Token IDs from https://huggingface.co/Qwen/Qwen3-Omni-30B-A3B-Instruct/blob/main/tokenizer_config.json
    config.audio_token_id = 151675  # <|audio_pad|>
    config.video_token_id = 151656  # <|video_pad|>
    config.image_token_id = 151655  # <|image_pad|>
    config.audio_start_token_id = 151669  # <|audio_start|>
    config.audio_end_token_id = 151670  # <|audio_end|>
    config.vision_start_token_id = 151652  # <|vision_start|>
    config.position_id_per_seconds = 12.5

    # Vision config
    vision_config = Mock()
    vision_config.spatial_merge_size = 2
    config.vision_config = vision_config

    return config


@pytest.fixture
def mock_processor():
    """Create a mock HF processor."""
    from transformers.models.whisper import WhisperFeatureExtractor

    processor = Mock()
    processor.audio_token = "<|audio_pad|>"
    processor.image_token = "<|image_pad|>"
    processor.video_token = "<|video_pad|>"

    # Create a real WhisperFeatureExtractor instance for the feature_extractor attribute
    feature_extractor = WhisperFeatureExtractor()
    processor.feature_extractor = feature_extractor

    return processor


@pytest.fixture
def mock_tokenizer():
    """Create a mock tokenizer."""
    tokenizer = Mock()
    # Token IDs from https://huggingface.co/Qwen/Qwen3-Omni-30B-A3B-Instruct/blob/main/tokenizer_config.json
    tokenizer.get_vocab = Mock(
        return_value={
            "<|audio_pad|>": 151675,
            "<|video_pad|>": 151656,
            "<|image_pad|>": 151655,
            "<|audio_start|>": 151669,
            "<|audio_end|>": 151670,
            "<|vision_start|>": 151652,
            "<|vision_end|>": 151653,
        }
    )
    tokenizer.encode = Mock(
        side_effect=lambda x: {
            "<|vision_start|>": [151652],
            "<|vision_end|>": [151653],
            "<|audio_start|>": [151669],
            "<|audio_end|>": [151670],
            "<|audio_pad|>": [151675],
            "<|image_pad|>": [151655],
            "<|video_pad|>": [151656],
        }.get(x, [0])
    )
    tokenizer.vision_bos_token = "<|vision_start|>"
    tokenizer.vision_eos_token = "<|vision_end|>"
    tokenizer.audio_bos_token = "<|audio_start|>"
    tokenizer.audio_eos_token = "<|audio_end|>"
    return tokenizer


@pytest.fixture
def mock_image_processor():
    """Create a mock image processor."""
    image_processor = Mock()
    image_processor.merge_size = 2
    return image_processor


def test_qwen3_omni_get_updates_use_audio_in_video(
    mock_qwen3_omni_config,
    mock_processor,
    mock_tokenizer,
    mock_image_processor,
    monkeypatch,
):
    """Test the get_updates_use_audio_in_video method directly."""
    from vllm.model_executor.models.qwen3_omni_moe_thinker import (
        Qwen3OmniMoeThinkerMultiModalProcessor,
        Qwen3OmniMoeThinkerProcessingInfo,
    )

    # Create a mock context
    mock_ctx = Mock(spec=InputProcessingContext)
    mock_ctx.tokenizer = mock_tokenizer
    # `model_config` is an instance attribute, so it is not covered by the
    # spec; the data parser reads it for `allow_missing_mm_embeddings`.
    mock_ctx.model_config = SimpleNamespace(
        multimodal_config=SimpleNamespace(allow_missing_mm_embeddings=False)
    )

    # Create processing info
    info = Qwen3OmniMoeThinkerProcessingInfo(mock_ctx)
    monkeypatch.setattr(info, "_get_expected_hidden_size", lambda: 100)
    monkeypatch.setattr(
        info, "get_hf_config", Mock(return_value=mock_qwen3_omni_config)
    )
    monkeypatch.setattr(info, "get_hf_processor", Mock(return_value=mock_processor))
    monkeypatch.setattr(info, "get_tokenizer", Mock(return_value=mock_tokenizer))
    monkeypatch.setattr(
        info, "get_image_processor", Mock(return_value=mock_image_processor)
    )

    # Create a mock dummy_inputs builder
    mock_dummy_inputs = Mock()

    # Create the processor
    processor = Qwen3OmniMoeThinkerMultiModalProcessor(info, mock_dummy_inputs)

    # Test parameters from reference video
    # https://qianwen-res.oss-cn-beijing.aliyuncs.com/Qwen3-Omni/demo/draw.mp4
    audio_len = 85
    video_grid_thw = [6, 36, 64]
    video_second_per_grid_t = 2.0

    # Call the method
    updates = processor.get_updates_use_audio_in_video(
        thinker_config=mock_qwen3_omni_config,
        audio_len=audio_len,
        video_grid_thw=video_grid_thw,
        video_second_per_grid_t=video_second_per_grid_t,
    )

    # Updated input ids should align with HF implementation.
    # 151669,
    # <|video_pad|> * 576, <|audio_pad|> * 25,
    # <|video_pad|> * 576, <|audio_pad|> * 25,
    # <|video_pad|> * 576, <|audio_pad|> * 25,
    # <|video_pad|> * 576, <|audio_pad|> * 10,
    # <|video_pad|> * 1152,
    # 151670
    print_input_ids(updates)

    # Verify structure
    assert isinstance(updates, list)
    assert len(updates) > 0

    # Verify start and end tokens
    audio_start_token_id = mock_qwen3_omni_config.audio_start_token_id
    audio_end_token_id = mock_qwen3_omni_config.audio_end_token_id

    assert updates[0] == audio_start_token_id
    assert updates[-1] == audio_end_token_id

    # Verify both audio and video tokens are present
    audio_token_id = mock_qwen3_omni_config.audio_token_id
    video_token_id = mock_qwen3_omni_config.video_token_id

    audio_count = updates.count(audio_token_id)
    video_count = updates.count(video_token_id)

    assert audio_count == audio_len, (
        f"Expected {audio_len} audio tokens, got {audio_count}"
    )

    # Calculate expected video token count
    spatial_merge_size = mock_qwen3_omni_config.vision_config.spatial_merge_size
    height = video_grid_thw[1] // spatial_merge_size
    width = video_grid_thw[2] // spatial_merge_size
    expected_video_count = video_grid_thw[0] * height * width

    assert video_count == expected_video_count, (
        f"Expected {expected_video_count} video tokens, got {video_count}"
    )

    # Total tokens should be: 1 (start) + audio_len + video_count + 1 (end)
    expected_total = 1 + audio_len + expected_video_count + 1
    assert len(updates) == expected_total, (
        f"Expected {expected_total} total tokens, got {len(updates)}"
    )


@pytest.mark.skip_global_cleanup
def test_qwen3_omni_exposes_eagle3_to_its_text_backbone():
    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3
    from vllm.model_executor.models.qwen3_omni_moe_thinker import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    class DummyBackbone(nn.Module, EagleModelMixin):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Identity(), nn.Identity()])

    class DummyLanguageModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = DummyBackbone()

        def embed_input_ids(self, input_ids):
            return input_ids

    model = Qwen3OmniMoeThinkerForConditionalGeneration.__new__(
        Qwen3OmniMoeThinkerForConditionalGeneration  # type: ignore[type-abstract]  # protocol attrs unset
    )
    nn.Module.__init__(model)
    model.language_model = DummyLanguageModel()

    # supports_eagle3() would narrow to a class: nn.Module is Any to mypy
    assert isinstance(model, SupportsEagle3)
    model.set_aux_hidden_state_layers((1, 2))
    assert model.language_model.model.aux_hidden_state_layers == (1, 2)


@pytest.mark.skip_global_cleanup
def test_qwen3_omni_text_model_collects_post_deepstack_aux_hidden_states():
    from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3MoeLLMModel

    class DummyLayer(nn.Module):
        def forward(self, positions, hidden_states, residual):
            return hidden_states + 1, torch.full_like(hidden_states, 10)

    class DummyNorm(nn.Module):
        def forward(self, hidden_states, residual):
            return hidden_states + residual, None

    model = Qwen3MoeLLMModel.__new__(Qwen3MoeLLMModel)
    nn.Module.__init__(model)
    model.start_layer = 0
    model.end_layer = 1
    model.layers = nn.ModuleList([DummyLayer()])
    model.norm = DummyNorm()
    model.aux_hidden_state_layers = (1,)

    pp_group = Mock(is_first_rank=True, is_last_rank=True)
    inputs_embeds = torch.tensor([[1.0]])
    deepstack_inputs = {"deepstack_input_embeds_0": torch.tensor([[3.0]])}
    with patch(
        "vllm.model_executor.models.qwen3_omni_moe_thinker.get_pp_group",
        return_value=pp_group,
    ):
        result = model.forward(
            input_ids=None,
            positions=torch.tensor([0]),
            inputs_embeds=inputs_embeds,
            deepstack_input_embeds=deepstack_inputs,
        )

    # aux_hidden_state_layers is set, so forward() returns a tuple.
    assert isinstance(result, tuple)
    output, aux_hidden_states = result

    torch.testing.assert_close(output, torch.tensor([[15.0]]))
    assert len(aux_hidden_states) == 1
    torch.testing.assert_close(aux_hidden_states[0], torch.tensor([[15.0]]))


def _dspark_vocab_stub(input_vocab_size: int, draft_vocab_size: int):
    """A Qwen3 DSpark model with only what `load_weights` reads."""
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    model = Qwen3DSparkForCausalLM.__new__(
        Qwen3DSparkForCausalLM  # type: ignore[type-abstract]  # protocol attrs unset
    )
    nn.Module.__init__(model)
    object.__setattr__(
        model,
        "config",
        SimpleNamespace(
            vocab_size=input_vocab_size,
            draft_vocab_size=draft_vocab_size,
        ),
    )
    object.__setattr__(model, "target_vocab_size", 100)
    object.__setattr__(model, "model", Mock(confidence_head=None))
    return model


@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("draft_vocab_size", [100, 101])
def test_qwen3_dspark_accepts_draft_vocab_at_least_target(draft_vocab_size):
    """A draft vocab >= the target's maps identically, so needs no lm_head/d2t.

    Guards the padded case (draft > target): the draft's unembedding is padded
    to its physical size, which is not a reduced vocabulary.
    """
    model = _dspark_vocab_stub(100, draft_vocab_size)

    model.load_weights([])


@pytest.mark.skip_global_cleanup
def test_dspark_shares_target_embedding_with_smaller_draft_vocabulary():
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.worker.gpu.spec_decode.dspark import utils as dspark_utils

    target_embedding = nn.Embedding(100, 8)
    draft_embedding = nn.Embedding(99, 8)
    target_model = SimpleNamespace(model=SimpleNamespace(embed_tokens=target_embedding))
    draft_model = SimpleNamespace(
        model=SimpleNamespace(embed_tokens=draft_embedding),
        has_own_embed_tokens=False,
    )
    draft_model_config = SimpleNamespace(
        hf_config=SimpleNamespace(model_type="qwen3"),
        get_vocab_size=Mock(return_value=99),
    )
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(
            draft_model_config=draft_model_config,
            draft_parallel_config=SimpleNamespace(tensor_parallel_size=1),
            attention_backend=None,
            kv_cache_dtype=None,
            draft_load_config=None,
            draft_lm_head_quantization=None,
        ),
        parallel_config=ParallelConfig(),
        attention_config=SimpleNamespace(backend=None),
        cache_config=SimpleNamespace(),
        load_config=SimpleNamespace(load_format="auto"),
        model_config=SimpleNamespace(get_vocab_size=Mock(return_value=100)),
    )

    def fake_replace(config, **changes):
        values = vars(config).copy()
        values.update(changes)
        return SimpleNamespace(**values)

    with (
        patch.object(dspark_utils, "replace", side_effect=fake_replace),
        patch(
            "vllm.v1.worker.gpu.spec_decode.eagle.utils.get_pp_group",
            return_value=SimpleNamespace(world_size=1),
        ),
        patch(
            "vllm.v1.worker.gpu.spec_decode.utils.get_pp_group",
            return_value=SimpleNamespace(world_size=1),
        ),
        patch(
            "vllm.compilation.backends.set_model_tag",
            return_value=nullcontext(),
        ),
        patch(
            "vllm.model_executor.model_loader.get_model",
            return_value=draft_model,
        ),
        patch(
            "vllm.model_executor.model_loader.utils.get_model_cls",
            return_value=Qwen3DSparkForCausalLM,
        ),
        patch(
            "vllm.model_executor.models.qwen3_dflash.dflash_has_any_non_causal",
            return_value=False,
        ),
        patch(
            "vllm.model_executor.models.utils.get_draft_quant_config",
            return_value=None,
        ),
    ):
        loaded_model = dspark_utils.load_dspark_model(target_model, vllm_config)

    assert loaded_model.model.embed_tokens is target_embedding


if __name__ == "__main__":
    pytest.main([__file__, "-v"])
