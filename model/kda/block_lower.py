"""Block-lower-triangular C x C algebra for the chunked KDA core (model/kda/chunk.py): the decayed score matrices
are lower triangular, so they are kept as diagonal blocks plus strips below and the zero upper part is never
computed; `unit_lower_inverse` is the UT transform's (I + L)^-1 by recursive halving."""

from __future__ import annotations

import torch


def as_batched(x: torch.Tensor) -> torch.Tensor:
    """[..., R, D] as a [batch, R, D] view (never a copy: in-place batched matmuls write through it)."""
    return x.view(-1, x.shape[-2], x.shape[-1])


class BlockLower:
    """A lower-triangular [..., C, C] matrix kept as its n_s diagonal S x S blocks ([..., n_s, S, S]) and, below
    each diagonal block b < n_s - 1, the strip of all later rows in b's columns ([..., C - (b + 1) S, S]). With
    C = 64 and two sub-blocks a quarter of every C x C product (the zero upper block) is never computed."""

    def __init__(self, diag: torch.Tensor, strips: list[torch.Tensor]):
        self.diag, self.strips = diag, strips
        self.n_s, self.S = diag.shape[-3], diag.shape[-1]

    def _blk(self, Z: torch.Tensor) -> torch.Tensor:  # [..., C, D] -> [..., n_s, S, D]
        return Z.view(*Z.shape[:-2], self.n_s, self.S, Z.shape[-1])

    def _rows(self, b: int) -> tuple[int, int]:  # strip b: rows r0.., columns r0 - S..r0
        return (b + 1) * self.S, b * self.S

    @staticmethod
    def outer(terms: list[tuple[torch.Tensor, torch.Tensor, float]], n_s: int, diagonal: int) -> BlockLower:
        """tril(sum_j alpha_j X_j Y_j^T, diagonal) for X_j, Y_j [..., C, D], only on the stored blocks."""
        X0 = terms[0][0]
        C = X0.shape[-2]
        S = C // n_s
        blk = lambda Z: Z.view(*Z.shape[:-2], n_s, S, Z.shape[-1]).flatten(0, -3)  # noqa: E731
        X, Y, alpha = terms[0]
        diag = torch.bmm(blk(X), blk(Y).transpose(-1, -2))
        if alpha != 1.0:
            diag.mul_(alpha)
        for X, Y, alpha in terms[1:]:
            diag.baddbmm_(blk(X), blk(Y).transpose(-1, -2), alpha=alpha)
        diag = diag.view(*X0.shape[:-2], n_s, S, S).tril_(diagonal)
        strips = []
        for b in range(n_s - 1):
            r0, c0 = (b + 1) * S, b * S
            X, Y, alpha = terms[0]
            St = X[..., r0:, :] @ Y[..., c0:r0, :].transpose(-1, -2)
            if alpha != 1.0:
                St.mul_(alpha)
            for X, Y, alpha in terms[1:]:
                St.flatten(0, -3).baddbmm_(
                    X[..., r0:, :].flatten(0, -3), Y[..., c0:r0, :].flatten(0, -3).transpose(-1, -2), alpha=alpha
                )
            strips.append(St)
        return BlockLower(diag, strips)

    def mm(self, Z: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
        """M @ Z for Z [..., C, D] (added into `acc` when given)."""
        if acc is None:
            Y = torch.matmul(self.diag, self._blk(Z)).view_as(Z)
        else:
            Y = acc
            self._blk(Y).flatten(0, -3).baddbmm_(self.diag.flatten(0, -3), self._blk(Z).flatten(0, -3))
        for b, St in enumerate(self.strips):
            r0, c0 = self._rows(b)
            as_batched(Y[..., r0:, :]).baddbmm_(as_batched(St), as_batched(Z[..., c0:r0, :]))
        return Y

    def mm_t(self, Z: torch.Tensor) -> torch.Tensor:
        """M^T @ Z for Z [..., C, D]."""
        Y = torch.matmul(self.diag.transpose(-1, -2), self._blk(Z)).view_as(Z)
        for b, St in enumerate(self.strips):
            r0, c0 = self._rows(b)
            as_batched(Y[..., c0:r0, :]).baddbmm_(as_batched(St).transpose(-1, -2), as_batched(Z[..., r0:, :]))
        return Y

    def scale_rows_(self, beta: torch.Tensor) -> BlockLower:
        """Diag(beta) M in place, beta [..., C]."""
        self.diag.mul_(beta.view(*beta.shape[:-1], self.n_s, self.S, 1))
        for b, St in enumerate(self.strips):
            St.mul_(beta[..., self._rows(b)[0] :, None])
        return self

    def scale_rows(self, beta: torch.Tensor, strip_scale: float = 1.0) -> BlockLower:
        """Diag(beta) M, its strips times `strip_scale` as well (for `unit_inverse`'s scaled strips)."""
        return BlockLower(
            self.diag * beta.view(*beta.shape[:-1], self.n_s, self.S, 1),
            [St * (beta[..., self._rows(b)[0] :, None] * strip_scale) for b, St in enumerate(self.strips)],
        )

    def row_dot(self, other: BlockLower) -> torch.Tensor:
        """sum_i M[r, i] O[r, i] per row r: [..., C]."""
        out = (self.diag * other.diag).sum(-1).flatten(-2)
        for b, (St, Ot) in enumerate(zip(self.strips, other.strips)):
            out[..., self._rows(b)[0] :].add_((St * Ot).sum(-1))
        return out

    def unit_inverse(self, strip_scale: float = 1.0, floor: float = 0.0) -> BlockLower:
        """(I + M)^-1 for strictly lower M, blockwise: T_bb = (I + M_bb)^-1 for all diagonal blocks at once, then
        from the last strip back, T[after b, b] = -T[after b, after b] M[after b, b] T_bb.

        `strip_scale`: this matrix's strips hold M's strips times strip_scale (a power of two: exact), so the
        strip products run on scaled values; the inverse's strips come back unscaled, entries of magnitude up to
        `floor` flushed to 0 (model/kda/chunk.py: the decayed couplings there reach 1e-45, and their products,
        unscaled, would be fp32 subnormals)."""
        Td = unit_lower_inverse(self.diag)
        strips: list[torch.Tensor] = [None] * len(self.strips)  # type: ignore[list-item]
        S = self.S
        for b in range(self.n_s - 2, -1, -1):
            r0 = (b + 1) * S
            Z = self.strips[b] @ Td[..., b, :, :]  # [..., C - r0, S]
            Y = torch.matmul(Td[..., b + 1 :, :, :], Z.view(*Z.shape[:-2], self.n_s - b - 1, S, S)).view_as(Z)
            for b2 in range(b + 1, self.n_s - 1):
                r2 = (b2 + 1) * S
                as_batched(Y[..., r2 - r0 :, :]).baddbmm_(
                    as_batched(strips[b2]), as_batched(Z[..., r2 - S - r0 : r2 - r0, :])
                )
            if strip_scale == 1.0 and floor == 0.0:
                strips[b] = Y.neg_()
            else:  # |x| <= floor -> 0 and unscale, as -x / strip_scale
                strips[b] = torch.nn.functional.hardshrink(Y, strip_scale * floor).mul_(-1.0 / strip_scale)
        return BlockLower(Td, strips)


def unit_lower_inverse(L_XCC: torch.Tensor, leaf: int = 32) -> torch.Tensor:
    """(I + L)^-1 for strictly lower L [..., C, C]. Halves recursively (both diagonal halves in one batched call;
    the off-diagonal block is -T22 L21 T11) down to `leaf`-sized triangular solves against I: small batched
    matmuls are much faster on CPU than batched LAPACK solves of the full size."""
    C = L_XCC.shape[-1]
    if leaf >= C or C % 2:
        eye_CC = torch.eye(C, dtype=L_XCC.dtype, device=L_XCC.device).expand_as(L_XCC)
        return torch.linalg.solve_triangular(L_XCC, eye_CC, upper=False, unitriangular=True)
    h = C // 2
    T_X2hh = unit_lower_inverse(torch.stack([L_XCC[..., :h, :h], L_XCC[..., h:, h:]], dim=-3), leaf)
    T11, T22 = T_X2hh.unbind(-3)
    T_XCC = L_XCC.new_zeros(L_XCC.shape)
    T_XCC[..., :h, :h] = T11
    T_XCC[..., h:, h:] = T22
    torch.matmul(T22, L_XCC[..., h:, :h] @ T11, out=T_XCC[..., h:, :h])
    T_XCC[..., h:, :h].neg_()
    return T_XCC
