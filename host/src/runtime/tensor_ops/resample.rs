//! Resampling of interleaved images (HWC), reproducing Pillow's `Image.resize`: a separable
//! filter, horizontal pass then vertical, with coefficients computed as Pillow's
//! `precompute_coeffs` does (support widened by the scale when shrinking). uint8 images use
//! Pillow's 22-bit fixed-point weights and round and clip between the passes, so results
//! equal Pillow's; fp32 images accumulate in f64 like Pillow's mode "F".

/// Bits of the fixed-point weights of 8-bit images (Pillow's PRECISION_BITS).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// For one output coordinate: the first source index and the normalised weights from there.
pub(super) struct Taps {
    pub first: usize,
    pub weights: Vec<f64>,
}

/// Triangle-filter coefficients mapping `src` samples onto `dst`.
pub(super) fn bilinear_taps(src: usize, dst: usize) -> Vec<Taps> {
    let scale = src as f64 / dst as f64;
    let filter_scale = scale.max(1.0);
    let support = filter_scale; // the triangle's support is 1
    let inverse = 1.0 / filter_scale;
    (0..dst)
        .map(|o| {
            let center = (o as f64 + 0.5) * scale;
            // C's (int) truncates toward zero; negative values clamp to 0 either way.
            let first = ((center - support + 0.5) as i64).max(0) as usize;
            let last = ((center + support + 0.5) as i64).clamp(0, src as i64) as usize;
            let mut weights: Vec<f64> = (first..last.max(first))
                .map(|x| {
                    let t = ((x as f64 - center + 0.5) * inverse).abs();
                    if t < 1.0 {
                        1.0 - t
                    } else {
                        0.0
                    }
                })
                .collect();
            let sum: f64 = weights.iter().sum();
            if sum != 0.0 {
                weights.iter_mut().for_each(|w| *w /= sum);
            }
            Taps {
                first: first.min(src.saturating_sub(1)),
                weights,
            }
        })
        .collect()
}

/// Source index of each output coordinate under nearest-neighbour sampling, accumulated the
/// way Pillow's affine scaler steps through the image.
pub(super) fn nearest_indices(src: usize, dst: usize) -> Vec<usize> {
    let step = src as f64 / dst as f64;
    let mut position = step * 0.5;
    (0..dst)
        .map(|_| {
            let index = (position.max(0.0) as usize).min(src - 1);
            position += step;
            index
        })
        .collect()
}

fn fixed(weights: &[f64]) -> Vec<i32> {
    let one = f64::from(1u32 << PRECISION_BITS);
    weights
        .iter()
        .map(|&w| {
            if w < 0.0 {
                (-0.5 + w * one) as i32
            } else {
                (0.5 + w * one) as i32
            }
        })
        .collect()
}

fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Horizontal then vertical triangle-filter pass over an 8-bit HWC image.
pub(super) fn bilinear_u8(
    src: &[u8],
    (height, width, channels): (usize, usize, usize),
    (out_h, out_w): (usize, usize),
) -> Vec<u8> {
    let columns = bilinear_taps(width, out_w);
    let rows = bilinear_taps(height, out_h);
    let round = 1i32 << (PRECISION_BITS - 1);
    let column_weights: Vec<Vec<i32>> = columns.iter().map(|t| fixed(&t.weights)).collect();
    let mut wide = vec![0u8; height * out_w * channels];
    if out_w == width {
        wide.copy_from_slice(src);
    } else {
        for (line, dst) in src
            .chunks_exact(width * channels)
            .zip(wide.chunks_exact_mut(out_w * channels))
        {
            for ((t, w), out) in columns
                .iter()
                .zip(&column_weights)
                .zip(dst.chunks_exact_mut(channels))
            {
                let window = &line[t.first * channels..(t.first + w.len()) * channels];
                if channels == 3 {
                    // The common case, with the accumulators in registers.
                    let mut acc = [round; 3];
                    for (px, &wk) in window.chunks_exact(3).zip(w) {
                        acc[0] += i32::from(px[0]) * wk;
                        acc[1] += i32::from(px[1]) * wk;
                        acc[2] += i32::from(px[2]) * wk;
                    }
                    out[0] = clip8(acc[0]);
                    out[1] = clip8(acc[1]);
                    out[2] = clip8(acc[2]);
                } else {
                    for (c, o) in out.iter_mut().enumerate() {
                        let mut acc = round;
                        for (px, &wk) in window.chunks_exact(channels).zip(w) {
                            acc += i32::from(px[c]) * wk;
                        }
                        *o = clip8(acc);
                    }
                }
            }
        }
    }
    if out_h == height {
        return wide;
    }
    let stride = out_w * channels;
    let mut out = vec![0u8; out_h * stride];
    let mut acc = vec![0i32; stride];
    for (t, dst) in rows.iter().zip(out.chunks_exact_mut(stride)) {
        acc.fill(round);
        for (k, wk) in fixed(&t.weights).into_iter().enumerate() {
            let line = &wide[(t.first + k) * stride..(t.first + k + 1) * stride];
            for (a, &v) in acc.iter_mut().zip(line) {
                *a += i32::from(v) * wk;
            }
        }
        for (d, &a) in dst.iter_mut().zip(&acc) {
            *d = clip8(a);
        }
    }
    out
}

/// Horizontal then vertical triangle-filter pass over an fp32 HWC image.
pub(super) fn bilinear_f32(
    src: &[f32],
    (height, width, channels): (usize, usize, usize),
    (out_h, out_w): (usize, usize),
) -> Vec<f32> {
    let columns = bilinear_taps(width, out_w);
    let rows = bilinear_taps(height, out_h);
    let mut wide = vec![0f32; height * out_w * channels];
    if out_w == width {
        wide.copy_from_slice(src);
    } else {
        for (line, dst) in src
            .chunks_exact(width * channels)
            .zip(wide.chunks_exact_mut(out_w * channels))
        {
            for (x, t) in columns.iter().enumerate() {
                for c in 0..channels {
                    let mut acc = 0f64;
                    for (k, w) in t.weights.iter().enumerate() {
                        acc += f64::from(line[(t.first + k) * channels + c]) * w;
                    }
                    dst[x * channels + c] = acc as f32;
                }
            }
        }
    }
    if out_h == height {
        return wide;
    }
    let stride = out_w * channels;
    let mut out = vec![0f32; out_h * stride];
    let mut acc = vec![0f64; stride];
    for (t, dst) in rows.iter().zip(out.chunks_exact_mut(stride)) {
        acc.fill(0.0);
        for (k, w) in t.weights.iter().enumerate() {
            let line = &wide[(t.first + k) * stride..(t.first + k + 1) * stride];
            for (a, &v) in acc.iter_mut().zip(line) {
                *a += f64::from(v) * w;
            }
        }
        for (d, &a) in dst.iter_mut().zip(&acc) {
            *d = a as f32;
        }
    }
    out
}

/// Nearest-neighbour resampling of any HWC image, `element` bytes per value.
pub(super) fn nearest(
    src: &[u8],
    (height, width, channels): (usize, usize, usize),
    (out_h, out_w): (usize, usize),
    element: usize,
) -> Vec<u8> {
    let pixel = channels * element;
    let xs = nearest_indices(width, out_w);
    let ys = nearest_indices(height, out_h);
    let mut out = Vec::with_capacity(out_h * out_w * pixel);
    for &y in &ys {
        let line = &src[y * width * pixel..(y + 1) * width * pixel];
        for &x in &xs {
            out.extend_from_slice(&line[x * pixel..(x + 1) * pixel]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sum_to_one_and_cover_the_source() {
        for (src, dst) in [(640, 224), (100, 300), (7, 7), (1, 5), (5, 1)] {
            for t in bilinear_taps(src, dst) {
                let sum: f64 = t.weights.iter().sum();
                assert!((sum - 1.0).abs() < 1e-9, "{src}->{dst}: {sum}");
                assert!(t.first + t.weights.len() <= src);
            }
        }
    }

    #[test]
    fn same_size_is_identity_and_constant_stays_constant() {
        let img: Vec<u8> = (0..4 * 6 * 3).map(|i| (i * 7 % 256) as u8).collect();
        assert_eq!(bilinear_u8(&img, (4, 6, 3), (4, 6)), img);
        let flat = vec![77u8; 30 * 40 * 3];
        assert!(bilinear_u8(&flat, (30, 40, 3), (11, 13))
            .iter()
            .all(|&v| v == 77));
        assert_eq!(nearest_indices(4, 2), vec![1, 3]);
    }
}
