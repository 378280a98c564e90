"""Zero-concentrated DP (Bun & Steinke 2016): composition and conversion to (eps, delta)-DP.

rho-zCDP means ``D_alpha(M(x) || M(x')) <= rho * alpha`` for every alpha > 1 and every pair of
neighbouring datasets. Composition (also fully adaptive, see :mod:`fedkl.privacy.filter`) adds rho.

Conversions to (eps, delta)-DP:

* ``bun_steinke``: eps = rho + 2 sqrt(rho ln(1/delta))  (Bun & Steinke 2016, Prop. 1.3).
* ``gaussian`` (exact, for Gaussian releases only): a composition of Gaussian mechanisms with total
  rho is exactly sqrt(2 rho)-GDP, whose privacy profile is closed-form (:func:`eps_gaussian`). The
  ledger accepts it only where every zCDP charge is a Gaussian release.
* ``cks`` (default, tighter): Canonne, Kamath & Steinke 2020, "The discrete Gaussian for
  differential privacy", Prop. 12 / Cor. 13:
  ``delta = min_{alpha>1} exp((alpha-1)(alpha rho - eps)) / (alpha-1) * (1-1/alpha)^alpha``,
  equivalently ``eps = min_{alpha>1} alpha rho + (ln(1/delta) + (alpha-1) ln(1-1/alpha) - ln alpha)/(alpha-1)``.
  For every alpha the bracket is below the Bun-Steinke one, whose minimum over alpha is exactly
  the Bun-Steinke formula, so ``cks <= bun_steinke`` always.

All minimizations over alpha are over a continuous variable (a dense log grid refined by a bounded
scalar search), so the value is never larger than dp-accounting's RDP value at the same rho, which
evaluates the same expression on a fixed grid of orders.

No scipy here (issue 34: a run converts eps <-> rho and summarises its ledger; importing scipy for it
cost a sixth of a small run's process): the bounded scalar search is :func:`_fminbound` (scipy's
``minimize_scalar(method="bounded")``, Brent 1973 ch. 5, step for step), the root finder is
:func:`_brentq` (scipy's ``brentq``, Brent 1973 ch. 4, step for step) and the normal cdf is from
``math.erf``/``math.erfc``; tests/privacy/test_zcdp_noscipy.py checks every conversion against the
scipy routines to 1e-12 relative.
"""

from __future__ import annotations

import math

import numpy as np

_SQRT_EPS = math.sqrt(2.2e-16)
_GOLDEN = 0.5 * (3.0 - math.sqrt(5.0))


def _fminbound(f, lo: float, hi: float, xatol: float = 1e-10, maxfun: int = 500) -> tuple[float, float]:
    """``(x, f(x))`` at a local minimum of ``f`` on ``[lo, hi]``: Brent's bounded minimisation
    (golden section with parabolic steps), the same steps as scipy's ``minimize_scalar(method="bounded")``."""
    a, b = lo, hi
    fulc = a + _GOLDEN * (b - a)
    nfc = xf = fulc
    rat = e = 0.0
    fx = f(xf)
    num = 1
    ffulc = fnfc = fx
    xm = 0.5 * (a + b)
    tol1 = _SQRT_EPS * abs(xf) + xatol / 3.0
    tol2 = 2.0 * tol1
    while abs(xf - xm) > tol2 - 0.5 * (b - a):
        golden = True
        if abs(e) > tol1:  # try a parabolic fit
            golden = False
            r = (xf - nfc) * (fx - ffulc)
            q = (xf - fulc) * (fx - fnfc)
            p = (xf - fulc) * q - (xf - nfc) * r
            q = 2.0 * (q - r)
            if q > 0.0:
                p = -p
            q = abs(q)
            r = e
            e = rat
            if abs(p) < abs(0.5 * q * r) and p > q * (a - xf) and p < q * (b - xf):
                rat = (p + 0.0) / q
                x = xf + rat
                if (x - a) < tol2 or (b - x) < tol2:
                    rat = tol1 * (1.0 if xm >= xf else -1.0)
            else:
                golden = True
        if golden:
            e = (a - xf) if xf >= xm else (b - xf)
            rat = _GOLDEN * e
        x = xf + (1.0 if rat >= 0 else -1.0) * max(abs(rat), tol1)
        fu = f(x)
        num += 1
        if fu <= fx:
            if x >= xf:
                a = xf
            else:
                b = xf
            fulc, ffulc = nfc, fnfc
            nfc, fnfc = xf, fx
            xf, fx = x, fu
        else:
            if x < xf:
                a = x
            else:
                b = x
            if fu <= fnfc or nfc == xf:
                fulc, ffulc = nfc, fnfc
                nfc, fnfc = x, fu
            elif fu <= ffulc or fulc == xf or fulc == nfc:
                fulc, ffulc = x, fu
        xm = 0.5 * (a + b)
        tol1 = _SQRT_EPS * abs(xf) + xatol / 3.0
        tol2 = 2.0 * tol1
        if num >= maxfun:
            break
    return xf, fx


def _brentq(
    f, xa: float, xb: float, xtol: float = 2e-12, rtol: float = 8.881784197001252e-16, maxiter: int = 100
) -> float:
    """A root of ``f`` in ``[xa, xb]`` (``f(xa)``, ``f(xb)`` of opposite signs): Brent's method
    (bisection, secant and inverse quadratic steps), the same steps as scipy's ``brentq``."""
    xpre, xcur = xa, xb
    xblk = fblk = spre = scur = 0.0
    fpre, fcur = f(xpre), f(xcur)
    if fpre == 0:
        return xpre
    if fcur == 0:
        return xcur
    if math.copysign(1.0, fpre) == math.copysign(1.0, fcur):
        raise ValueError("f(a) and f(b) must have different signs")
    for _ in range(maxiter):
        if fpre != 0 and fcur != 0 and math.copysign(1.0, fpre) != math.copysign(1.0, fcur):
            xblk, fblk = xpre, fpre
            spre = scur = xcur - xpre
        if abs(fblk) < abs(fcur):
            xpre, xcur, xblk = xcur, xblk, xcur
            fpre, fcur, fblk = fcur, fblk, fcur
        delta = (xtol + rtol * abs(xcur)) / 2
        sbis = (xblk - xcur) / 2
        if fcur == 0 or abs(sbis) < delta:
            return xcur
        if abs(spre) > delta and abs(fcur) < abs(fpre):
            if xpre == xblk:  # interpolate
                stry = -fcur * (xcur - xpre) / (fcur - fpre)
            else:  # extrapolate
                dpre = (fpre - fcur) / (xpre - xcur)
                dblk = (fblk - fcur) / (xblk - xcur)
                stry = -fcur * (fblk * dblk - fpre * dpre) / (dblk * dpre * (fblk - fpre))
            if 2 * abs(stry) < min(abs(spre), 3 * abs(sbis) - delta):
                spre, scur = scur, stry
            else:
                spre = scur = sbis
        else:
            spre = scur = sbis
        xpre, fpre = xcur, fcur
        xcur += scur if abs(scur) > delta else (delta if sbis > 0 else -delta)
        fcur = f(xcur)
    raise RuntimeError("brentq: no convergence")


def _ndtr(a: float) -> float:
    """The standard normal cdf (as scipy's ``ndtr``: erf near 0, erfc in the tails)."""
    x = a / math.sqrt(2.0)
    if abs(x) < 1.0:
        return 0.5 + 0.5 * math.erf(x)
    y = 0.5 * math.erfc(abs(x))
    return 1.0 - y if x > 0 else y


def _log_ndtr(a: float) -> float:
    """log of the standard normal cdf, accurate in the lower tail (asymptotic series below -20)."""
    if a > 6.0:
        return math.log1p(-_ndtr(-a))
    if a > -20.0:
        return math.log(_ndtr(a))
    total, last, term, i = 1.0, 0.0, 1.0, 0
    while abs(total - last) > 1e-17:  # log Phi(a) = -a^2/2 - log(-a sqrt(2 pi)) + log(sum_k (-1)^k (2k-1)!! / a^2k)
        i += 1
        last = total
        term *= -(2 * i - 1) / (a * a)
        total += term
    return -0.5 * a * a - math.log(-a) - 0.5 * math.log(2 * math.pi) + math.log(total)


CONVERSIONS = ("cks", "bun_steinke", "gaussian")


def _check_rho_delta(rho: float, delta: float) -> None:
    if not (rho >= 0 and math.isfinite(rho)):
        raise ValueError(f"rho must be finite and >= 0, got {rho}")
    if not (0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def _cks_eps_at(alpha: np.ndarray, rho: float, delta: float) -> np.ndarray:
    am1 = alpha - 1.0
    return alpha * rho + (math.log(1 / delta) + am1 * np.log1p(-1.0 / alpha) - np.log(alpha)) / am1


def eps_bun_steinke(rho: float, delta: float) -> float:
    """eps of rho-zCDP at delta by Bun & Steinke (2016), Prop. 1.3."""
    _check_rho_delta(rho, delta)
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


def eps_cks(rho: float, delta: float) -> float:
    """eps of rho-zCDP at delta by Canonne-Kamath-Steinke (2020), minimized over real alpha > 1."""
    _check_rho_delta(rho, delta)
    if rho == 0:
        return 0.0
    # search x = log(alpha - 1) on a dense grid, then refine around the best grid point
    xs = np.linspace(-12.0, 32.0, 4401)  # alpha - 1 from 6e-6 to 8e13 (tiny rho needs huge alpha)
    vals = _cks_eps_at(1.0 + np.exp(xs), rho, delta)
    i = int(np.nanargmin(vals))
    lo, hi = xs[max(i - 1, 0)], xs[min(i + 1, len(xs) - 1)]
    _, fun = _fminbound(lambda x: float(_cks_eps_at(np.array(1.0 + math.exp(x)), rho, delta)), lo, hi, xatol=1e-10)
    best = min(float(vals[i]), float(fun))
    return max(best, 0.0)


def zcdp_to_eps(rho: float, delta: float, conversion: str = "cks") -> float:
    """eps such that rho-zCDP implies (eps, delta)-DP, by the chosen conversion."""
    if conversion == "cks":
        return eps_cks(rho, delta)
    if conversion == "bun_steinke":
        return eps_bun_steinke(rho, delta)
    if conversion == "gaussian":
        return eps_gaussian(rho, delta)
    raise ValueError(f"unknown conversion {conversion!r}; choose one of {CONVERSIONS}")


def delta_cks(rho: float, eps: float) -> float:
    """delta such that rho-zCDP implies (eps, delta)-DP (CKS 2020, Prop. 12), min over alpha > 1."""
    if not (rho >= 0 and math.isfinite(rho)) or not (eps >= 0):
        raise ValueError(f"need rho >= 0 and eps >= 0, got rho={rho}, eps={eps}")
    if rho == 0:
        return 0.0

    def log_delta(x: float) -> float:
        a = 1.0 + math.exp(x)
        return (a - 1) * (a * rho - eps) - math.log(a - 1) + a * math.log1p(-1 / a)

    xs = np.linspace(-12.0, 16.0, 2801)
    vals = np.array([log_delta(x) for x in xs])
    i = int(np.argmin(vals))
    _, fun = _fminbound(log_delta, xs[max(i - 1, 0)], xs[min(i + 1, len(xs) - 1)], xatol=1e-10)
    return min(1.0, math.exp(min(vals[i], fun)))


def rho_for_eps_delta(eps: float, delta: float, conversion: str = "cks") -> float:
    """The largest rho whose conversion gives at most eps at delta.

    Bun-Steinke has the closed form ``(sqrt(ln(1/delta) + eps) - sqrt(ln(1/delta)))^2``. For CKS we
    bisect (eps_cks is increasing in rho) and return the lower end of the final bracket, so the
    returned rho never converts to more than eps.
    """
    if not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be finite and > 0, got {eps}")
    _check_rho_delta(0.0, delta)
    log_inv = math.log(1.0 / delta)
    rho_bs = (math.sqrt(log_inv + eps) - math.sqrt(log_inv)) ** 2
    if conversion == "bun_steinke":
        while eps_bun_steinke(rho_bs, delta) > eps:  # the closed form can round up by an ulp
            rho_bs *= 1 - 1e-12
        return rho_bs
    if conversion == "gaussian":
        return max(_rho_gaussian(eps, delta), rho_bs)  # exact <= Bun-Steinke, so rho_bs is always valid
    if conversion != "cks":
        raise ValueError(f"unknown conversion {conversion!r}; choose one of {CONVERSIONS}")
    lo, hi = rho_bs, rho_bs
    if rho_bs == 0 or eps_cks(lo, delta) >= eps:
        # at the limit of float precision: the Bun-Steinke rho is valid (CKS <= Bun-Steinke exactly)
        return rho_bs
    while eps_cks(hi, delta) <= eps:
        hi *= 2.0
    rho = _brentq(lambda r: eps_cks(r, delta) - eps, lo, hi, xtol=1e-14, rtol=1e-12)
    for _ in range(50):  # make the answer conservative (a few ulps of the numerical minimum)
        if eps_cks(rho, delta) <= eps:
            return max(rho, rho_bs)
        rho *= 1 - 1e-10
    return rho_bs  # always valid: CKS <= Bun-Steinke for every rho


class ZCDPAccountant:
    """Additive zCDP composition with (eps, delta) reporting."""

    def __init__(self) -> None:
        self.rho = 0.0
        self.events: list[tuple[str, float]] = []

    def compose(self, rho: float, label: str = "") -> None:
        if not (rho >= 0 and math.isfinite(rho)):
            raise ValueError(f"rho must be finite and >= 0, got {rho}")
        self.rho += rho
        self.events.append((label, rho))

    def epsilon(self, delta: float, conversion: str = "cks") -> float:
        return zcdp_to_eps(self.rho, delta, conversion)


# --- the exact conversion for Gaussian releases ------------------------------------------------------
def _gaussian_delta(mu: float, eps: float) -> float:
    """delta(eps) of mu-GDP, i.e. of the Gaussian mechanism with sensitivity/sigma = mu (Balle & Wang
    2018, Thm 8; Dong, Roth & Su 2022, Cor. 2.13): Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    if mu == 0:
        return 0.0
    a, b = -eps / mu + mu / 2, -eps / mu - mu / 2
    return max(0.0, float(_ndtr(a) - math.exp(eps + _log_ndtr(b))))


def eps_gaussian(rho: float, delta: float) -> float:
    """The EXACT eps at delta of a composition of Gaussian mechanisms with total zCDP rho.

    A Gaussian release with sensitivity D and noise sigma is mu_t-GDP with mu_t = D/sigma, and its
    zCDP cost is rho_t = mu_t^2/2. Gaussian DP composes exactly, also fully adaptively (Dong, Roth &
    Su 2022, Cor. 3.3; Smith & Thakurta 2022 for adaptively chosen mu_t): the composition is mu-GDP
    with mu^2 = sum_t mu_t^2 = 2 rho. Its privacy profile is :func:`_gaussian_delta`, so the eps
    returned (the smallest eps with delta(eps) <= delta, by bisection, rounded up) is exact. Valid
    ONLY when every zCDP charge is a Gaussian release: the ledger checks the mechanism of each charge.
    For rho = 0.15 at delta = 1e-10: 3.416 (CKS: 3.574, Bun-Steinke: 3.867; tests/privacy/test_accounting.py).
    """
    _check_rho_delta(rho, delta)
    if rho == 0:
        return 0.0
    mu = math.sqrt(2.0 * rho)
    if _gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while _gaussian_delta(mu, hi) > delta:
        hi *= 2.0
    eps = _brentq(lambda e: _gaussian_delta(mu, e) - delta, lo, hi, xtol=1e-13, rtol=1e-13)
    while _gaussian_delta(mu, eps) > delta:  # conservative: never report below the exact value
        eps *= 1 + 1e-12
    return eps


def _rho_gaussian(eps: float, delta: float) -> float:
    """The largest rho = mu^2/2 whose Gaussian profile has delta(eps) <= delta (delta increases with mu)."""
    lo, hi = 0.0, 1.0
    while _gaussian_delta(hi, eps) <= delta:
        hi *= 2.0
    mu = _brentq(lambda m: _gaussian_delta(m, eps) - delta, lo, hi, xtol=1e-14, rtol=1e-13)
    # conservative against the reported value too: eps_gaussian of the answer never exceeds eps
    while _gaussian_delta(mu, eps) > delta or eps_gaussian(mu * mu / 2.0, delta) > eps:
        mu *= 1 - 1e-10
    return mu * mu / 2.0
