//! The running batch's key/value cache in the layout decoders exported by Optimum take: per
//! layer a key and a value tensor `[rows, kv_heads, columns, head_dim]`, one row per sequence.
//!
//! Every row holds its tokens right-aligned: a row of `n` tokens uses the last `n` columns and
//! the attention mask hides the columns before them. A decode step appends one column to every
//! row at once, so rows stay right-aligned; the width is the longest row, never more (leading
//! columns that no row uses are dropped whenever the batch changes). So the memory the cache
//! holds is at most `rows x longest row`, which is what admission budgets.

/// Where one row of a rebuilt tensor comes from.
#[derive(Debug, Clone, Copy)]
pub struct RowSource {
    /// Which source tensor.
    pub tensor: usize,
    /// Its row there.
    pub row: usize,
    /// Tokens the row holds (its last `len` columns).
    pub len: usize,
}

/// A source tensor: its data `[rows, heads, columns, head_dim]` and its column count.
#[derive(Debug, Clone, Copy)]
pub struct Source<'a> {
    /// The values.
    pub data: &'a [f32],
    /// Its columns (third dimension).
    pub columns: usize,
}

/// Builds a tensor `[rows.len(), heads, columns, head_dim]` whose row `r` holds the last
/// `rows[r].len` columns of its source row, right-aligned, zeros before them.
pub fn relayout(
    sources: &[Source<'_>],
    rows: &[RowSource],
    heads: usize,
    head_dim: usize,
    columns: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; rows.len() * heads * columns * head_dim];
    for (r, from) in rows.iter().enumerate() {
        let src = &sources[from.tensor];
        let len = from.len.min(columns).min(src.columns);
        for h in 0..heads {
            let src_start = ((from.row * heads + h) * src.columns + src.columns - len) * head_dim;
            let dst_start = ((r * heads + h) * columns + columns - len) * head_dim;
            out[dst_start..dst_start + len * head_dim]
                .copy_from_slice(&src.data[src_start..src_start + len * head_dim]);
        }
    }
    out
}

/// The attention mask `[rows, columns]` of right-aligned rows of `lens` tokens.
pub fn mask(lens: &[usize], columns: usize) -> Vec<i64> {
    let mut out = vec![0i64; lens.len() * columns];
    for (r, &len) in lens.iter().enumerate() {
        let len = len.min(columns);
        out[r * columns + columns - len..(r + 1) * columns].fill(1);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_move_right_aligned_and_the_rest_is_zero() {
        // Two heads, head_dim 1. Source A: 1 row of 3 columns; source B: 2 rows of 1 column.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [7.0, 8.0, 9.0, 10.0];
        let sources = [
            Source {
                data: &a,
                columns: 3,
            },
            Source {
                data: &b,
                columns: 1,
            },
        ];
        let rows = [
            RowSource {
                tensor: 1,
                row: 1,
                len: 1,
            },
            RowSource {
                tensor: 0,
                row: 0,
                len: 2,
            },
        ];
        let out = relayout(&sources, &rows, 2, 1, 2);
        assert_eq!(out, vec![0.0, 9.0, 0.0, 10.0, 2.0, 3.0, 5.0, 6.0]);
        assert_eq!(mask(&[1, 2], 3), vec![0, 0, 1, 0, 1, 1]);
    }
}
