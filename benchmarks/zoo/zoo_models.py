"""The model zoo's architectures: torch modules with random weights, built from config objects.

Each family has a ``full`` configuration (the published architecture: ResNet-50, BERT-base, ...)
and a ``small`` one (the same code path with tiny widths, few layers and small inputs, for
``make test``).  Nothing is downloaded: torchvision ``weights=None``, timm ``pretrained=False``,
transformers models built from a ``*Config``.  Needs the ``zoo`` extra (torch, torchvision,
timm, transformers, onnxscript); never imported by apollo_py itself.

``build(name, size)`` returns a :class:`ZooModel`: the module in eval mode, example inputs, their
names and which of their axes are dynamic in the export.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

SIZES = ("small", "full")


@dataclass
class ZooModel:
    """A torch module ready to export: ``module(*inputs)`` returns one tensor or a tuple."""

    name: str
    family: str
    module: nn.Module
    inputs: tuple
    input_names: list
    output_names: list
    dynamic_axes: dict = field(default_factory=dict)  # input name -> {axis: dim name}


def _randomize_norms(module: nn.Module, seed: int) -> None:
    """Give every norm layer random affine parameters and running statistics.

    Fresh modules have BatchNorm mean 0 / var 1 / gamma 1 and timm zero-initialises the last
    gamma of each residual block, which would make whole branches vanish and the comparison
    weaker than on a trained model.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            w = getattr(m, "weight", None)
            is_norm = isinstance(m, (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)) \
                or type(m).__name__.endswith(("RMSNorm", "LayerNorm", "LayerNorm2d"))
            if not is_norm or not isinstance(w, torch.Tensor):
                continue
            w.copy_(torch.rand(w.shape, generator=g) + 0.5)
            b = getattr(m, "bias", None)
            if isinstance(b, torch.Tensor):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
            rm, rv = getattr(m, "running_mean", None), getattr(m, "running_var", None)
            if isinstance(rm, torch.Tensor) and isinstance(rv, torch.Tensor):
                rm.copy_(torch.randn(rm.shape, generator=g) * 0.1)
                rv.copy_(torch.rand(rv.shape, generator=g) + 0.5)


def _image(module, size, hw, name, family, channels=3):
    x = torch.randn(1, channels, hw, hw, generator=torch.Generator().manual_seed(1))
    return ZooModel(name, family, module, (x,), ["x"], ["y"], {"x": {0: "batch"}})


class _LastHidden(nn.Module):
    """Wraps a transformers model so that export sees one tensor in, one tensor out."""

    def __init__(self, model, **call_kw):
        super().__init__()
        self.model = model
        self.call_kw = call_kw

    def forward(self, x):
        out = self.model(x, **self.call_kw)
        return out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state


def _text(model, size, seq, vocab, name, family, **call_kw):
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    return ZooModel(name, family, _LastHidden(model, **call_kw), (ids,), ["input_ids"], ["y"],
                    {"input_ids": {0: "batch", 1: "seq"}})


# --- CNNs ------------------------------------------------------------------------------------


def resnet(size):
    import timm
    from timm.models.resnet import Bottleneck, ResNet
    if size == "full":
        return _image(timm.create_model("resnet50", pretrained=False), size, 224, "resnet50", "cnn")
    m = ResNet(Bottleneck, (1, 1, 1, 1), num_classes=10, stem_width=8, channels=(8, 16, 16, 32))
    return _image(m, size, 32, "resnet_small", "cnn")


def mobilenetv3(size):
    import torchvision
    if size == "full":
        return _image(torchvision.models.mobilenet_v3_large(weights=None), size, 224,
                      "mobilenetv3_large", "cnn")
    from timm.models.mobilenetv3 import _gen_mobilenet_v3
    m = _gen_mobilenet_v3("mobilenetv3_small_100", 0.125, num_classes=10)
    # the 1024-wide head holds most of the weights: a 64-wide one keeps the file small
    m.conv_head = nn.Conv2d(m.conv_head.in_channels, 64, 1)
    m.classifier = nn.Linear(64, 10)
    return _image(m, size, 32, "mobilenetv3_small", "cnn")


def efficientnet(size):
    import timm
    from timm.models.efficientnet import _gen_efficientnet
    if size == "full":
        return _image(timm.create_model("efficientnet_b0", pretrained=False), size, 224,
                      "efficientnet_b0", "cnn")
    from timm.layers import BatchNormAct2d
    m = _gen_efficientnet("efficientnet_b0", channel_multiplier=0.125, depth_multiplier=0.34,
                          num_classes=10)
    m.conv_head = nn.Conv2d(m.conv_head.in_channels, 64, 1, bias=False)  # 1280 -> 64: small file
    m.bn2 = BatchNormAct2d(64, act_layer=nn.SiLU)
    m.classifier = nn.Linear(64, 10)
    return _image(m, size, 32, "efficientnet_small", "cnn")


def convnext(size):
    import timm
    from timm.models.convnext import ConvNeXt
    if size == "full":
        return _image(timm.create_model("convnext_tiny", pretrained=False), size, 224, "convnext_tiny",
                      "cnn")
    m = ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 16, 32), num_classes=10)
    return _image(m, size, 32, "convnext_small", "cnn")


def regnet(size):
    import timm
    from timm.models.regnet import RegNet, RegNetCfg
    if size == "full":
        return _image(timm.create_model("regnety_016", pretrained=False), size, 224, "regnety_016", "cnn")
    cfg = RegNetCfg(depth=6, w0=8, wa=8.0, wm=2.0, group_size=8, se_ratio=0.25, stem_width=8)
    return _image(RegNet(cfg, num_classes=10), size, 32, "regnet_small", "cnn")


class UNet(nn.Module):
    """A 3-level UNet: conv blocks, max-pool down, ConvTranspose up at one level and
    bilinear Resize up at the other, skip connections by Concat."""

    def __init__(self, c=(8, 16, 32), in_ch=3, out_ch=2):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(),
                                 nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())
        self.d0, self.d1, self.mid = block(in_ch, c[0]), block(c[0], c[1]), block(c[1], c[2])
        self.pool = nn.MaxPool2d(2)
        self.up1 = nn.ConvTranspose2d(c[2], c[1], 2, stride=2)
        self.u1 = block(2 * c[1], c[1])
        self.red = nn.Conv2d(c[1], c[0], 1)
        self.u0 = block(2 * c[0], c[0])
        self.head = nn.Conv2d(c[0], out_ch, 1)

    def forward(self, x):
        s0 = self.d0(x)
        s1 = self.d1(self.pool(s0))
        m = self.mid(self.pool(s1))
        y = self.u1(torch.cat([self.up1(m), s1], 1))
        y = nn.functional.interpolate(self.red(y), scale_factor=2.0, mode="bilinear", align_corners=False)
        return self.head(self.u0(torch.cat([y, s0], 1)))


def unet(size):
    if size == "full":
        return _image(UNet((32, 64, 128)), size, 128, "unet", "cnn")
    return _image(UNet((4, 8, 8)), size, 16, "unet_small", "cnn")


# --- vision transformers -----------------------------------------------------------------------


def vit(size):
    import timm
    from timm.models.vision_transformer import VisionTransformer
    if size == "full":
        return _image(timm.create_model("vit_base_patch16_224", pretrained=False), size, 224,
                      "vit_b16", "vit")
    m = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0,
                          num_classes=10)
    return _image(m, size, 32, "vit_small", "vit")


def swin(size):
    import timm
    from timm.models.swin_transformer import SwinTransformer
    if size == "full":
        return _image(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False), size, 224,
                      "swin_t", "vit")
    m = SwinTransformer(img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(1, 1),
                        num_heads=(1, 2), mlp_ratio=2.0, num_classes=10)
    return _image(m, size, 32, "swin_small", "vit")


# --- encoders / decoders (transformers) ----------------------------------------------------------

_SMALL_TEXT = dict(vocab=128, seq=16)
_FULL_SEQ = 128


def bert(size):
    from transformers import BertConfig, BertModel
    if size == "full":
        cfg = BertConfig()
        return _text(BertModel(cfg, add_pooling_layer=False).eval(), size, _FULL_SEQ, cfg.vocab_size,
                     "bert_base", "encoder")
    cfg = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    return _text(BertModel(cfg, add_pooling_layer=False).eval(), size, 16, 128, "bert_small", "encoder")


def distilbert(size):
    from transformers import DistilBertConfig, DistilBertModel
    if size == "full":
        cfg = DistilBertConfig()
        return _text(DistilBertModel(cfg).eval(), size, _FULL_SEQ, cfg.vocab_size, "distilbert",
                     "encoder")
    cfg = DistilBertConfig(vocab_size=128, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                           max_position_embeddings=64)
    return _text(DistilBertModel(cfg).eval(), size, 16, 128, "distilbert_small", "encoder")


def gpt2(size):
    from transformers import GPT2Config, GPT2Model
    if size == "full":
        cfg = GPT2Config()
        return _text(GPT2Model(cfg).eval(), size, _FULL_SEQ, cfg.vocab_size, "gpt2", "decoder",
                     use_cache=False)
    cfg = GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    return _text(GPT2Model(cfg).eval(), size, 16, 128, "gpt2_small", "decoder", use_cache=False)


def llama(size):
    from transformers import LlamaConfig, LlamaModel
    if size == "full":
        cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
        return _text(LlamaModel(cfg).eval(), size, _FULL_SEQ, cfg.vocab_size, "llama_4l", "decoder",
                     use_cache=False)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return _text(LlamaModel(cfg).eval(), size, 16, 128, "llama_small", "decoder", use_cache=False)


class _T5(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, decoder_input_ids):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids,
                          use_cache=False).last_hidden_state


def t5(size):
    from transformers import T5Config, T5Model
    if size == "full":
        cfg, seq, name = T5Config(), _FULL_SEQ, "t5_small"  # T5Config() is t5-small
    else:
        cfg = T5Config(vocab_size=128, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                       relative_attention_num_buckets=8)
        seq, name = 16, "t5_tiny"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    dec = torch.randint(0, cfg.vocab_size, (1, seq // 2), generator=g)
    return ZooModel(name, "encdec", _T5(T5Model(cfg).eval()), (ids, dec),
                    ["input_ids", "decoder_input_ids"], ["y"],
                    {"input_ids": {0: "batch", 1: "seq"}, "decoder_input_ids": {0: "batch", 1: "dseq"}})


def whisper_encoder(size):
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder
    if size == "full":
        cfg, name = WhisperConfig(d_model=384, encoder_layers=4, encoder_attention_heads=6,
                                  encoder_ffn_dim=1536, num_mel_bins=80), "whisper_tiny_encoder"
    else:
        cfg, name = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=2,
                                  encoder_ffn_dim=64, num_mel_bins=16, max_source_positions=32), \
            "whisper_small_encoder"
    frames = 2 * cfg.max_source_positions
    x = torch.randn(1, cfg.num_mel_bins, frames, generator=torch.Generator().manual_seed(1))
    return ZooModel(name, "encdec", _LastHidden(WhisperEncoder(cfg).eval()), (x,), ["features"], ["y"],
                    {"features": {0: "batch"}})


# --- recommendation, recurrent -------------------------------------------------------------------


class DLRM(nn.Module):
    """DLRM-style: a bottom MLP on dense features, embedding lookups for sparse ids, pairwise dot
    interaction (bmm of the stacked vectors, upper triangle), a top MLP with a sigmoid."""

    def __init__(self, dense=13, tables=(1000,) * 8, dim=16, bottom=(64, 16), top=(64, 32, 1)):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(n, dim) for n in tables)
        self.bot = self._mlp((dense,) + bottom)
        n = len(tables) + 1
        self.register_buffer("iu", torch.triu_indices(n, n, 1), persistent=False)
        self.top = self._mlp((dim + n * (n - 1) // 2,) + top)

    @staticmethod
    def _mlp(sizes):
        layers = []
        for i, o in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(i, o), nn.ReLU()]
        return nn.Sequential(*layers[:-1])

    def forward(self, dense, sparse):
        x = self.bot(dense)
        vs = torch.stack([x] + [e(sparse[:, k]) for k, e in enumerate(self.emb)], 1)
        z = torch.bmm(vs, vs.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        return torch.sigmoid(self.top(torch.cat([x, z], 1)))


def dlrm(size):
    if size == "full":
        m, b, name, tables = DLRM(tables=(100000,) * 8, dim=64, bottom=(512, 256, 64), top=(512, 256, 1)), \
            64, "dlrm", 100000
    else:
        m, b, name, tables = DLRM(tables=(50,) * 4, dim=8, bottom=(16, 8), top=(16, 1)), 4, "dlrm_small", 50
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(b, 13, generator=g)
    sparse = torch.randint(0, tables, (b, len(m.emb)), generator=g)
    return ZooModel(name, "recsys", m, (dense, sparse), ["dense", "sparse"], ["y"],
                    {"dense": {0: "batch"}, "sparse": {0: "batch"}})


class Recurrent(nn.Module):
    """A 2-layer LSTM followed by a GRU and a linear head (sequence-first, as ONNX's LSTM)."""

    def __init__(self, feat, hidden, out=4):
        super().__init__()
        self.lstm = nn.LSTM(feat, hidden, num_layers=2)
        self.gru = nn.GRU(hidden, hidden)
        self.head = nn.Linear(hidden, out)

    def forward(self, x):
        y, _ = self.lstm(x)
        y, _ = self.gru(y)
        return self.head(y)


def rnn(size):
    feat, hidden, seq, b, name = (64, 256, 50, 4, "lstm_gru") if size == "full" else (8, 16, 10, 2, "lstm_gru_small")
    x = torch.randn(seq, b, feat, generator=torch.Generator().manual_seed(1))
    return ZooModel(name, "recurrent", Recurrent(feat, hidden), (x,), ["x"], ["y"], {"x": {0: "seq", 1: "batch"}})


FAMILIES: dict[str, Callable[[str], ZooModel]] = {
    "resnet": resnet, "mobilenetv3": mobilenetv3, "efficientnet": efficientnet, "convnext": convnext,
    "regnet": regnet, "unet": unet, "vit": vit, "swin": swin, "bert": bert, "distilbert": distilbert,
    "gpt2": gpt2, "llama": llama, "t5": t5, "whisper_encoder": whisper_encoder, "dlrm": dlrm, "rnn": rnn,
}


def build(family: str, size: str, seed: int = 0) -> ZooModel:
    """The ``size`` ("small" or "full") configuration of ``family`` with seeded random weights."""
    if size not in SIZES:
        raise ValueError(f"size {size!r}: expected one of {SIZES}")
    torch.manual_seed(seed)
    zm = FAMILIES[family](size)
    zm.module.eval()
    _randomize_norms(zm.module, seed + 1)
    return zm
