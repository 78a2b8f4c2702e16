"""Export the tiny torch modules of tests/layers/stitch_models (layer-2/3 stitching tests).

Run with a Python that has torch (2.x, with onnxscript for the dynamo exporter):
``python tools/export_stitch_models.py tests/layers/stitch_models``.
"""
import sys, torch, torch.nn as nn, torch.nn.functional as F
out = sys.argv[1]
torch.manual_seed(0)

class LSE(nn.Module):
    def forward(self, x): return torch.logsumexp(x, dim=-1)
class MeanSqrt(nn.Module):
    def forward(self, x): return torch.sqrt(x.mean(dim=-1, keepdim=True))
class RMS(nn.Module):
    def __init__(s, d, mode): super().__init__(); s.w = nn.Parameter(torch.rand(d) + 0.5); s.mode = mode
    def forward(self, x):
        v = x.pow(2).mean(-1, keepdim=True) + 1e-6
        if self.mode == "div": return x / torch.sqrt(v) * self.w
        if self.mode == "rsqrt": return x * torch.rsqrt(v) * self.w
        return x * torch.reciprocal(torch.sqrt(v)) * self.w
class L2(nn.Module):
    def forward(self, x): return F.normalize(x, dim=-1)
class GN(nn.Module):
    def __init__(s): super().__init__(); s.gn = nn.GroupNorm(4, 16); nn.init.uniform_(s.gn.weight, 0.5, 1.5); nn.init.uniform_(s.gn.bias, -0.5, 0.5)
    def forward(self, x): return self.gn(x)
class MaskSoftmax(nn.Module):
    def forward(self, s, m): return torch.softmax(s.masked_fill(m, float("-inf")) , dim=-1)
class MaskAddSoftmax(nn.Module):
    def forward(self, s, m): return torch.softmax(s + m, dim=-1)
class Four(nn.Module):
    def forward(self, a, b, c, d):
        return torch.cat([torch.relu(a) * 2.0, torch.tanh(b), torch.sigmoid(c) + 1.0, d * d], dim=1)

x = torch.randn(64, 256)
cases = {
 "logsumexp": (LSE(), (x,), ["x"]),
 "mean_sqrt": (MeanSqrt(), (x.abs(),), ["x"]),
 "rmsnorm_div": (RMS(256, "div"), (x,), ["x"]),
 "rmsnorm_rsqrt": (RMS(256, "rsqrt"), (x,), ["x"]),
 "rmsnorm_recip": (RMS(256, "recip"), (x,), ["x"]),
 "l2norm": (L2(), (x,), ["x"]),
 "groupnorm": (GN(), (torch.randn(2, 16, 8, 8),), ["x"]),
 "masked_softmax_where": (MaskSoftmax(), (torch.randn(2, 4, 32, 32), torch.triu(torch.ones(32, 32, dtype=torch.bool), 1)), ["s", "m"]),
 "masked_softmax_add": (MaskAddSoftmax(), (torch.randn(2, 4, 32, 32), torch.randn(1, 1, 32, 32)), ["s", "m"]),
 "four_branch": (Four(), tuple(torch.randn(8, 64) for _ in range(4)), ["a", "b", "c", "d"]),
}
for name, (mod, args, names) in cases.items():
    for dyn in (False, True):
        kind = "dynamo" if dyn else "torchscript"
        try:
            torch.onnx.export(mod, args, f"{out}/{name}.{kind}.onnx", input_names=names, opset_version=18, dynamo=dyn, external_data=False) if dyn else \
            torch.onnx.export(mod, args, f"{out}/{name}.{kind}.onnx", input_names=names, opset_version=17, dynamo=False)
        except Exception as e:
            print(name, kind, "FAILED", type(e).__name__, str(e)[:200])
