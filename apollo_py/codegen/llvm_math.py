"""Branch-free float32 math functions as LLVM IR text, so that loops calling them vectorise.

``llvm.exp.v16f32`` and friends are scalarised into libm calls on x86 (measured 6x slower
for softmax), so exp, log, tanh, erf, sigmoid and pow are written here as polynomials with
``select`` for the special cases.  Each function is ``internal`` and ``alwaysinline``; after
inlining the loop vectoriser sees only arithmetic, compares, selects and bit casts.

Algorithms (max relative error vs numpy in float32 is checked by tests/codegen):

* exp: Cephes ``expf`` -- n = rint(x log2 e), Cody-Waite reduction r = x - n ln2 (two
  constants), exp(r) = 1 + r (1 + r Q(r)) with a degree-4 minimax Q (Horner, 6 FMAs),
  scale by 2^n as two factors 2^(n>>1) 2^(n-(n>>1)) so results that overflow become inf
  and results in the subnormal range round once.  Input
  clamped to [-104, 88.8]; NaN propagates.  On AVX-512 (``scalef``): n = lrint(x log2 e) as
  an i32 (vcvtps2dq) and the result is ldexp(y, n) (vscalefps), no NaN select.
* log: Cephes ``logf`` -- frexp by bit manipulation (subnormals pre-scaled by 2^23),
  mantissa folded to [sqrt(1/2), sqrt(2)), degree-8 polynomial; log(0) = -inf,
  log(x < 0) = nan, log(inf) = inf.
* tanh: expm1(2x) / (expm1(2x) + 2), 2x clamped to +-20 (tanh is +-1 in float32 from
  |2x| = 18.1); expm1(2x) = 2^n expm1(r) + (2^n - 1) with exp's Cephes reduction and
  polynomial, so it is accurate near 0 and near +-1 alike (GELU's 1 + tanh needs the latter).
* erf: x P(x^2) / Q(x^2), x clamped to [-4, 4] where erf = +-1 in float32 (the rational of
  Eigen and XLA; 4.4e-7 max relative error).
* sigmoid: 1 / (1 + exp(-x)).
* pow (non-constant exponent): exp(b log|a|) with the sign fixed for negative bases and
  integral exponents; exactly 1 when b == 0 or a == 1.
"""
from __future__ import annotations

import struct

FLAGS = "nsz contract"  # no nnan/ninf: the special cases below rely on inf/nan compares


def fconst(value: float) -> str:
    """Return the LLVM IR literal of ``value`` rounded to float32 (hex double form)."""
    f32 = struct.unpack("<f", struct.pack("<f", float(value)))[0]
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", f32))[0]


def dconst(value: float) -> str:
    """Return the LLVM IR literal of the float64 ``value``."""
    return "0x%016X" % struct.unpack("<Q", struct.pack("<d", float(value)))[0]


INF = "0x7FF0000000000000"
NINF = "0xFFF0000000000000"
NAN = "0x7FF8000000000000"


class _Fn:
    """Accumulates the SSA lines of one float function."""

    def __init__(self, scalef: bool = False):
        self.lines = []
        self.n = 0
        self.scalef = scalef

    def op(self, text: str) -> str:
        self.n += 1
        reg = f"%v{self.n}"
        self.lines.append(f"  {reg} = {text}")
        return reg

    def f(self, opc: str, a: str, b: str) -> str:
        return self.op(f"{opc} {FLAGS} float {a}, {b}")

    def poly(self, x: str, coeffs) -> str:
        """Horner evaluation of sum(c_k x^(n-k)) with fused multiply-adds."""
        acc = fconst(coeffs[0])
        for c in coeffs[1:]:
            acc = self.op(f"call float @llvm.fma.f32(float {acc}, float {x}, float {fconst(c)})")
        return acc

    def sel(self, cond: str, a: str, b: str, ty: str = "float") -> str:
        return self.op(f"select i1 {cond}, {ty} {a}, {ty} {b}")

    def cmp(self, pred: str, a: str, b: str) -> str:
        return self.op(f"fcmp {pred} float {a}, {b}")


#: exp(r) ~= 1 + r + r^2 Q(r) on |r| <= ln2/2: Q of degree 4, minimax in relative error
#: (Lawson-weighted least squares, float32 coefficients): 3.6e-9 = 0.06 ulp before rounding
_EXP_Q4 = [1.3814539415761828E-3, 8.3687454462051392E-3, 4.1668388992547989E-2,
           1.6666521131992340E-1, 4.9999994039535522E-1]


def _reduce_exp(fn: _Fn, x: str, ni: str = "", plus_one: bool = False) -> tuple[str, str]:
    """Cephes' reduction of a clamped ``x``: ``(n, expm1(r))`` with ``x = n ln2 + r`` (two-part
    ln2), ``n = rint(x / ln2)`` (0 for NaN) and ``expm1(r) = r + r^2 P(r)``.  With ``ni`` (an
    i32 holding ``lrint(x / ln2)``, see :func:`_exp`) ``n`` is ``sitofp(ni)`` instead.  With
    ``plus_one`` the second value is ``exp(r) = 1 + r (1 + r Q(r))`` with the degree-4
    minimax ``Q`` (:data:`_EXP_Q4`): 6 FMAs where Cephes' form takes 5, r*r, an FMA and an add."""
    if ni:
        n = fn.op(f"sitofp i32 {ni} to float")
    else:
        t = fn.f("fmul", x, fconst(1.44269504088896341))
        n = fn.op(f"call float @llvm.rint.f32(float {t})")
        n = fn.sel(fn.cmp("uno", x, x), fconst(0.0), n)
    r = fn.op(f"call float @llvm.fma.f32(float {n}, float {fconst(-0.693359375)}, float {x})")
    r = fn.op(f"call float @llvm.fma.f32(float {n}, float {fconst(2.12194440e-4)}, float {r})")
    if plus_one:
        p = fn.poly(r, _EXP_Q4)
        q = fn.op(f"call float @llvm.fma.f32(float {p}, float {r}, float {fconst(1.0)})")
        return n, fn.op(f"call float @llvm.fma.f32(float {q}, float {r}, float {fconst(1.0)})")
    p = fn.poly(r, [1.9875691500E-4, 1.3981999507E-3, 8.3334519073E-3, 4.1665795894E-2,
                    1.6666665459E-1, 5.0000001201E-1])
    z = fn.f("fmul", r, r)
    return n, fn.op(f"call float @llvm.fma.f32(float {p}, float {z}, float {r})")


def _exp(fn: _Fn, x: str, upper_clamp: bool = True) -> str:
    lo = fn.cmp("olt", x, fconst(-104.0))
    x1 = fn.sel(lo, fconst(-104.0), x)
    x2 = fn.sel(fn.cmp("ogt", x1, fconst(88.8)), fconst(88.8), x1) if upper_clamp else x1
    if fn.scalef:
        # one vscalefps: overflow to inf and one rounding into subnormals, as below.  n comes
        # from llvm.lrint (one vcvtps2dq) and its sitofp is the one the backend puts in front
        # of vscalefps anyway (CSE'd): rint + NaN select + fptosi + sitofp cost 4 vector ops,
        # this 2.  lrint(NaN) is an unspecified i32, not poison (LangRef), and r, hence the
        # result, is NaN for a NaN x whatever n is.
        t = fn.f("fmul", x2, fconst(1.44269504088896341))
        ni = fn.op(f"call i32 @llvm.lrint.i32.f32(float {t})")
        n, y = _reduce_exp(fn, x2, ni, plus_one=True)
        return fn.op(f"call float @llvm.ldexp.f32.i32(float {y}, i32 {ni})")
    n, y = _reduce_exp(fn, x2, plus_one=True)
    ni = fn.op(f"fptosi float {n} to i32")
    n1 = fn.op(f"ashr i32 {ni}, 1")
    n2 = fn.op(f"sub i32 {ni}, {n1}")
    scales = []
    for k in (n1, n2):
        b = fn.op(f"add i32 {k}, 127")
        b = fn.op(f"shl i32 {b}, 23")
        scales.append(fn.op(f"bitcast i32 {b} to float"))
    y = fn.f("fmul", y, scales[0])
    return fn.f("fmul", y, scales[1])


def _exp_nonpos(fn: _Fn, x: str) -> str:
    """exp of an argument known to be <= 88.7 or NaN (softmax's ``x - max(x)``): no upper clamp."""
    return _exp(fn, x, upper_clamp=False)


def _log(fn: _Fn, x: str, specials: bool = True) -> str:
    if specials:
        den = fn.cmp("olt", x, fconst(1.17549435e-38))
        xs = fn.f("fmul", x, fconst(8388608.0))
        xa = fn.sel(den, xs, x)
        ea = fn.sel(den, "-23", "0", "i32")
    else:
        xa, ea = x, "0"
    bits = fn.op(f"bitcast float {xa} to i32")
    ex = fn.op(f"lshr i32 {bits}, 23")
    ex = fn.op(f"and i32 {ex}, 255")
    e = fn.op(f"add i32 {ex}, -126")
    e = fn.op(f"add i32 {e}, {ea}")
    mb = fn.op(f"and i32 {bits}, 8388607")
    mb = fn.op(f"or i32 {mb}, 1056964608")
    m = fn.op(f"bitcast i32 {mb} to float")
    small = fn.cmp("olt", m, fconst(0.707106781186547524))
    dec = fn.op(f"zext i1 {small} to i32")
    e = fn.op(f"sub i32 {e}, {dec}")
    m2 = fn.f("fadd", m, m)
    mm = fn.sel(small, m2, m)
    xr = fn.f("fsub", mm, fconst(1.0))
    z = fn.f("fmul", xr, xr)
    p = fn.poly(xr, [7.0376836292E-2, -1.1514610310E-1, 1.1676998740E-1, -1.2420140846E-1,
                     1.4249322787E-1, -1.6668057665E-1, 2.0000714765E-1, -2.4999993993E-1,
                     3.3333331174E-1])
    y = fn.f("fmul", xr, z)
    y = fn.f("fmul", y, p)
    fe = fn.op(f"sitofp i32 {e} to float")
    y = fn.op(f"call float @llvm.fma.f32(float {fe}, float {fconst(-2.12194440e-4)}, float {y})")
    y = fn.op(f"call float @llvm.fma.f32(float {z}, float {fconst(-0.5)}, float {y})")
    r = fn.f("fadd", xr, y)
    r = fn.op(f"call float @llvm.fma.f32(float {fe}, float {fconst(0.693359375)}, float {r})")
    if not specials:
        return fn.sel(fn.cmp("uno", x, x), x, r)
    r = fn.sel(fn.cmp("oeq", x, fconst(0.0)), NINF, r)
    r = fn.sel(fn.cmp("olt", x, fconst(0.0)), NAN, r)
    r = fn.sel(fn.cmp("oeq", x, INF), INF, r)
    return fn.sel(fn.cmp("uno", x, x), x, r)


def _log_normal(fn: _Fn, x: str) -> str:
    """log of an argument known to be a positive normal float or NaN (log-softmax's sum of
    exps, >= 1): no subnormal pre-scaling, no zero, negative or inf cases."""
    return _log(fn, x, specials=False)


def _tanh(fn: _Fn, x: str) -> str:
    """tanh(x) = expm1(2x) / (expm1(2x) + 2), one branch-free path (no cancellation near 0:
    expm1 is computed as 2^n expm1(r) + (2^n - 1) with Cephes' reduction and polynomial)."""
    a = fn.f("fadd", x, x)
    # tanh rounds to +-1 in float32 beyond |2x| = 18.1: clamp (NaN passes) so 2^n is normal
    a = fn.sel(fn.cmp("ogt", a, fconst(20.0)), fconst(20.0), a)
    a = fn.sel(fn.cmp("olt", a, fconst(-20.0)), fconst(-20.0), a)
    n, em_r = _reduce_exp(fn, a)
    ni = fn.op(f"fptosi float {n} to i32")
    if fn.scalef:
        sc = fn.op(f"call float @llvm.ldexp.f32.i32(float {fconst(1.0)}, i32 {ni})")
    else:
        b = fn.op(f"add i32 {ni}, 127")
        sc = fn.op(f"bitcast i32 {fn.op(f'shl i32 {b}, 23')} to float")
    sm1 = fn.f("fsub", sc, fconst(1.0))
    em = fn.op(f"call float @llvm.fma.f32(float {sc}, float {em_r}, float {sm1})")
    d = fn.f("fadd", em, fconst(2.0))
    # the sign of x, so that tanh(-0.0) is -0.0 as in numpy (expm1 loses it)
    return fn.op(f"call float @llvm.copysign.f32(float {fn.f('fdiv', em, d)}, float {x})")


#: erf(x) ~= x P(x^2) / Q(x^2) on [-4, 4] (Eigen's / XLA's float32 rational, numerator odd of
#: degree 13, denominator even of degree 8): 4.4e-7 max relative error against math.erf, one
#: division and 13 FMAs -- the earlier Cephes erff / erfcf pair (both branches, an exp, two
#: polynomials of degree 7-8) took ~3x as long, which GELU epilogues pay per element
_ERF_P = [-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02]
_ERF_Q = [-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02]


def _erf(fn: _Fn, x: str) -> str:
    # clamp to [-4, 4] (erf is +-1 in float32 beyond) with ordered compares: NaN passes through
    c = fn.sel(fn.cmp("ogt", x, fconst(4.0)), fconst(4.0), x)
    c = fn.sel(fn.cmp("olt", c, fconst(-4.0)), fconst(-4.0), c)
    z = fn.f("fmul", c, c)
    p = fn.f("fmul", c, fn.poly(z, _ERF_P))
    q = fn.poly(z, _ERF_Q)
    r = fn.f("fdiv", p, q)
    # |x| < 2^-12: erf(x) = 2/sqrt(pi) x (1 - x^2/3 ...) to 2e-8; one rounding, so subnormal x
    # keeps its precision (x P(x^2) underflows first in the rational)
    ax = fn.op(f"call float @llvm.fabs.f32(float {x})")
    lin = fn.f("fmul", x, fconst(1.1283791670955126))
    return fn.sel(fn.cmp("olt", ax, fconst(2.0 ** -12)), lin, r)


def _sigmoid(fn: _Fn, x: str) -> str:
    nx = fn.op(f"fneg {FLAGS} float {x}")
    e = fn.op(f"call float @ap.expf(float {nx})")
    d = fn.f("fadd", e, fconst(1.0))
    return fn.f("fdiv", fconst(1.0), d)


def _pow(fn: _Fn, a: str, b: str) -> str:
    aa = fn.op(f"call float @llvm.fabs.f32(float {a})")
    la = fn.op(f"call float @ap.logf(float {aa})")
    t = fn.f("fmul", b, la)
    r = fn.op(f"call float @ap.expf(float {t})")
    fb = fn.op(f"call float @llvm.floor.f32(float {b})")
    isint = fn.cmp("oeq", fb, b)
    half = fn.f("fmul", b, fconst(0.5))
    fh = fn.op(f"call float @llvm.floor.f32(float {half})")
    odd = fn.op(f"and i1 {isint}, {fn.cmp('une', fh, half)}")
    nr = fn.op(f"fneg {FLAGS} float {r}")
    signed = fn.sel(odd, nr, r)
    # a negative base (-0.0 included: its odd powers keep the sign, as in numpy) takes an
    # integer power's sign; -inf to a non-integer power is +inf or +0 like |a|, not NaN
    bad = fn.op(f"and i1 {fn.cmp('olt', a, fconst(0.0))}, {fn.cmp('one', a, fconst(float('-inf')))}")
    neg_res = fn.sel(isint, signed, fn.sel(bad, NAN, r))
    neg = fn.op(f"icmp slt i32 {fn.op(f'bitcast float {a} to i32')}, 0")
    res = fn.sel(neg, neg_res, r)
    res = fn.sel(fn.cmp("oeq", b, fconst(1.0)), a, res)             # exact, no overflow at the ends
    ab = fn.op(f"call float @llvm.fabs.f32(float {b})")
    one_inf = fn.op(f"and i1 {fn.cmp('oeq', aa, fconst(1.0))}, {fn.cmp('oeq', ab, fconst(float('inf')))}")
    res = fn.sel(one_inf, fconst(1.0), res)                             # (-1) ** +-inf = 1 (C99, numpy)
    res = fn.sel(fn.cmp("oeq", b, fconst(0.0)), fconst(1.0), res)
    return fn.sel(fn.cmp("oeq", a, fconst(1.0)), fconst(1.0), res)


_BUILDERS = {"expf": (_exp, 1), "expf_nonpos": (_exp_nonpos, 1), "logf": (_log, 1),
             "logf_normal": (_log_normal, 1), "tanhf": (_tanh, 1), "erff": (_erf, 1),
             "sigmoidf": (_sigmoid, 1), "powf": (_pow, 2)}
#: functions each helper calls, so a module includes them too
DEPENDS = {"sigmoidf": ("expf",),
           "powf": ("expf", "logf")}

#: declarations the helpers need; the renderer merges them with its own (deduplicated)
INTRINSIC_DECLS = (
    "declare float @llvm.fma.f32(float, float, float)",
    "declare float @llvm.rint.f32(float)",
    "declare float @llvm.fabs.f32(float)",
    "declare float @llvm.floor.f32(float)",
    "declare float @llvm.copysign.f32(float, float)",
    "declare float @llvm.ldexp.f32.i32(float, i32)",
    "declare i32 @llvm.lrint.i32.f32(float)",
)


def helper_names(used) -> list:
    """Return the helpers needed for ``used`` (names like ``"expf"``), dependencies included."""
    out = []
    stack = list(used)
    while stack:
        n = stack.pop()
        if n not in out:
            out.append(n)
            stack.extend(DEPENDS.get(n, ()))
    return sorted(out)


def render_helpers(used, scalef: bool = False) -> str:
    """Return LLVM IR text defining ``@ap.<name>`` for each helper in ``used`` (+ deps).

    Expects names from ``expf expf_nonpos logf logf_normal tanhf erff sigmoidf powf``; the module must also contain
    the declarations in :data:`INTRINSIC_DECLS` (once).  ``scalef`` (set for AVX-512 hosts,
    where LLVM vectorises ``llvm.ldexp`` to one ``vscalefps``) scales exp's result by 2^n
    with ``llvm.ldexp`` instead of integer exponent arithmetic (same results: ldexp rounds
    once and overflows to inf); elsewhere ldexp would become scalar libm calls.
    """
    names = helper_names(used)
    parts = []
    for name in names:
        builder, arity = _BUILDERS[name]
        fn = _Fn(scalef)
        args = ["%a", "%b"][:arity]
        res = builder(fn, *args)
        sig = ", ".join(f"float {a}" for a in args)
        body = "\n".join(fn.lines)
        parts.append(f"define internal float @ap.{name}({sig}) #1 {{\n{body}\n"
                     f"  ret float {res}\n}}\n")
    return "\n".join(parts)
