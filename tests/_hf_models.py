"""Small transformers models outside the zoo, each bringing ops the zoo's
models do not use, with random weights (no hub): tests/test_dtr_hf.py trains
them on CPU, tests/_dtr_gpu_worker.py (scenario hf) the first five on CUDA
(its HF_MODELS).

* t5: relative position buckets (log, min, where) and their bias, T5's
  RMS layer norm, cross attention, the decoder's shifted labels.
* mixtral: sparse experts (router softmax, top-k, one_hot, per-expert
  index_add_ of token slices) and the router's auxiliary loss, grouped-query
  attention.
* mamba: the selective scan's reference loop (a state carried over the
  sequence, one einsum a token), a causal depthwise conv1d, softplus.
* swin: shifted windows (roll, window partition by view and permute), the
  relative position table gathered by an index buffer, the shift's attention
  mask, stochastic depth (torch.rand in the model).
* clip: two towers, the text tower's end token found by argmax and indexed,
  the contrastive loss through logit_scale.exp().
* wav2vec2: the convolutional feature encoder with group norm, the
  positional conv under a weight_norm parametrization, time masking (numpy's
  RNG picks the spans; the learned mask embedding written in by index), and
  CTC loss.
* wav2vec2_pretraining: the Gumbel-softmax quantizer (its noise drawn by
  `exponential_` into an `empty_like`), negatives gathered by sampled
  indices, the cosine-similarity contrastive loss.
* deberta_v2: disentangled attention (relative positions bucketed by log and
  sign, gathered into the scores by index), and its own dropout, a custom
  autograd.Function whose mask `bernoulli_` draws into an `empty_like`.
* fnet: Fourier mixing instead of attention (`fft_fftn` into complex
  tensors, their real part read through a view).
* vit_mae: random masking (uniform noise, `argsort` twice, `gather` of the
  kept patches and of the restored order), an encoder and a decoder.
* longformer: sliding-window attention by chunks overlapping through
  `as_strided` views, diagonals padded and re-strided, global attention on
  the first token.
* bigbird: block-sparse attention, its random blocks drawn with numpy's RNG
  in the forward, the blocks gathered and multiplied by einsum.
* reformer: reversible layers, a custom autograd.Function whose backward
  runs each layer's forward again (reseeding the RNG with the seed the
  layer drew at its forward) and a backward inside it; LSH attention (random
  rotations, argsort into buckets, chunks). The layers draw their seeds with
  `torch.seed()`, which is not reproducible: the test replaces it.
"""
from __future__ import annotations

import numpy as np
import torch
import transformers

VOCAB = 96


def _t5():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config), lambda g: dict(
        input_ids=torch.randint(3, VOCAB, (2, 12), generator=g), labels=torch.randint(3, VOCAB, (2, 9), generator=g))


def _causal_lm(model):
    def batch(g):
        ids = torch.randint(3, VOCAB, (2, 16), generator=g)
        return dict(input_ids=ids, labels=ids)

    return model, batch


def _mixtral():
    config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, attention_dropout=0.1, max_position_embeddings=64,
                                        output_router_logits=True)
    return _causal_lm(transformers.MixtralForCausalLM(config))


def _mamba():
    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                      conv_kernel=4, use_mambapy=False)
    return _causal_lm(transformers.MambaForCausalLM(config))


def _images(classes):
    return lambda g: dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g),
                          labels=torch.randint(0, classes, (2,), generator=g))


def _swin():
    config = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 1], num_heads=[2, 2],
                                     window_size=4, num_labels=5, hidden_dropout_prob=0.1,
                                     attention_probs_dropout_prob=0.1, drop_path_rate=0.2)
    return transformers.SwinForImageClassification(config), _images(5)


def _clip():
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32, attention_dropout=0.1,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, attention_dropout=0.1))
    return transformers.CLIPModel(config), lambda g: dict(
        input_ids=torch.randint(3, VOCAB, (2, 10), generator=g), pixel_values=torch.randn(2, 3, 32, 32, generator=g),
        return_loss=True)


def _wav2vec2():
    config = transformers.Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, hidden_dropout=0.1, attention_dropout=0.1, activation_dropout=0.1,
        feat_proj_dropout=0.1, layerdrop=0.0, mask_time_prob=0.3, mask_time_length=2, do_stable_layer_norm=True,
        pad_token_id=0, ctc_loss_reduction="mean")
    return transformers.Wav2Vec2ForCTC(config), lambda g: dict(
        input_values=torch.randn(2, 1600, generator=g), labels=torch.randint(1, VOCAB, (2, 5), generator=g))


def _wav2vec2_pretraining():
    config = transformers.Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, hidden_dropout=0.1, layerdrop=0.0, codevector_dim=16,
        proj_codevector_dim=16, num_codevectors_per_group=8, num_codevector_groups=2, num_negatives=4)
    model = transformers.Wav2Vec2ForPreTraining(config)
    from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices, _sample_negative_indices

    def batch(g):
        # transformers draws the masked spans and the negatives with numpy's
        # global RNG: seeded from g, so a batch is the same in every run.
        np.random.seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        frames = int(model._get_feat_extract_output_lengths(torch.tensor(1600)))
        mask = _compute_mask_indices((2, frames), mask_prob=0.3, mask_length=2)
        negatives = _sample_negative_indices((2, frames), config.num_negatives, mask_time_indices=mask)
        return dict(input_values=torch.randn(2, 1600, generator=g), mask_time_indices=torch.tensor(mask),
                    sampled_negative_indices=torch.tensor(negatives))

    return model, batch


def _classify(model, length=16):
    return model, lambda g: dict(input_ids=torch.randint(3, VOCAB, (2, length), generator=g),
                                 labels=torch.randint(0, 3, (2,), generator=g))


_ENCODER = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, num_labels=3)


def _deberta_v2():
    config = transformers.DebertaV2Config(**_ENCODER, relative_attention=True, position_buckets=8,
                                          max_relative_positions=16, pos_att_type=["p2c", "c2p"])
    return _classify(transformers.DebertaV2ForSequenceClassification(config))


def _fnet():
    config = transformers.FNetConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                     hidden_dropout_prob=0.1, num_labels=3, use_tpu_fourier_optimizations=False)
    return _classify(transformers.FNetForSequenceClassification(config))


def _vit_mae():
    config = transformers.ViTMAEConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
        patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1, decoder_num_attention_heads=4,
        decoder_intermediate_size=64, mask_ratio=0.5, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return transformers.ViTMAEForPreTraining(config), lambda g: dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g))


def _longformer():
    config = transformers.LongformerConfig(**_ENCODER, attention_window=4, pad_token_id=1, max_position_embeddings=64)
    return _classify(transformers.LongformerForSequenceClassification(config))


def _bigbird():
    config = transformers.BigBirdConfig(**_ENCODER, attention_type="block_sparse", block_size=2, num_random_blocks=2,
                                        max_position_embeddings=128)
    return _classify(transformers.BigBirdForSequenceClassification(config), length=32)


def _reformer():
    config = transformers.ReformerConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        attn_layers=["local", "lsh", "local", "lsh"], feed_forward_size=64, axial_pos_embds=False,
        max_position_embeddings=64, local_attn_chunk_length=8, lsh_attn_chunk_length=8, num_buckets=4, num_hashes=2,
        hidden_dropout_prob=0.1, lsh_attention_probs_dropout_prob=0.1, local_attention_probs_dropout_prob=0.1,
        is_decoder=True, pad_token_id=0, eos_token_id=2)
    return _causal_lm(transformers.ReformerModelWithLMHead(config))


MODELS = {"t5": _t5, "mixtral": _mixtral, "mamba": _mamba, "swin": _swin, "clip": _clip, "wav2vec2": _wav2vec2,
          "wav2vec2_pretraining": _wav2vec2_pretraining, "deberta_v2": _deberta_v2, "fnet": _fnet,
          "vit_mae": _vit_mae, "longformer": _longformer, "bigbird": _bigbird, "reformer": _reformer}


def on(batch: dict, device) -> dict:
    """The batch's tensors on `device` (made on the CPU, so every device trains on the same numbers)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
