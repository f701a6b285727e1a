//! 8-bit BGR images and the two OpenCV operations PP-OCR's reference pipeline applies to them:
//! `cv2.resize` (bilinear, pixel centres aligned, no anti-aliasing) and `cv2.warpPerspective`
//! (bicubic, a = -0.75, replicated border), both in OpenCV's own fixed-point arithmetic, so
//! that the crops the recogniser reads are the reference's, pixel for pixel: one grey level
//! at the edge of a gap between two words can decide whether a space is read there.

/// An interleaved 3-channel image, channels in B, G, R order (what the PP-OCR models expect).
#[derive(Clone, Debug)]
pub struct Bgr {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

impl Bgr {
    /// From interleaved RGB bytes.
    pub fn from_rgb(width: usize, height: usize, rgb: &[u8]) -> Self {
        let mut data = rgb.to_vec();
        for px in data.chunks_exact_mut(3) {
            px.swap(0, 2);
        }
        Self {
            width,
            height,
            data,
        }
    }

    /// `cv2.resize(img, (width, height))` with INTER_LINEAR.
    pub fn resize(&self, width: usize, height: usize) -> Bgr {
        let mut data = vec![0u8; width * height * 3];
        self.resize_each(width, height, |x, y, c, v| {
            data[(y * width + x) * 3 + c] = v as u8;
        });
        Bgr {
            width,
            height,
            data,
        }
    }

    /// `rows` black rows added above and below (`cv2.copyMakeBorder`, BORDER_CONSTANT 0).
    pub fn with_bands(&self, rows: usize) -> Bgr {
        let band = vec![0u8; rows * self.width * 3];
        let mut data = Vec::with_capacity(self.data.len() + 2 * band.len());
        data.extend_from_slice(&band);
        data.extend_from_slice(&self.data);
        data.extend_from_slice(&band);
        Bgr {
            width: self.width,
            height: self.height + 2 * rows,
            data,
        }
    }

    /// `cv2.resize(img, (width, height))` followed by PP-OCR's normalisation
    /// `(v / 255 - 0.5) / 0.5`, written as little-endian FP32 planes (B, G, R)
    /// `canvas_width` wide into `out`; columns past `width` are left as they are (the
    /// recogniser's zero padding).
    pub fn resize_normalized(
        &self,
        width: usize,
        height: usize,
        canvas_width: usize,
        out: &mut [u8],
    ) {
        let plane = canvas_width * height;
        self.resize_each(width, height, |x, y, c, v| {
            let at = (c * plane + y * canvas_width + x) * 4;
            out[at..at + 4].copy_from_slice(&(v / 127.5 - 1.0).to_le_bytes());
        });
    }

    /// INTER_LINEAR resampling to `width` x `height` in OpenCV's fixed-point arithmetic for
    /// 8-bit images, bit for bit: 11-bit weights, rows interpolated horizontally into
    /// integers, then blended vertically as its SIMD code does (each row's value shifted
    /// right by 4, multiplied by the weight keeping the high 16 bits, the two summed and
    /// rounded off by 2 bits). Handed to `put(x, y, channel, value)`.
    fn resize_each(
        &self,
        width: usize,
        height: usize,
        mut put: impl FnMut(usize, usize, usize, f32),
    ) {
        let xs = taps(width, self.width, true);
        let ys = taps(height, self.height, false);
        let mut rows = vec![0i64; self.height * 3 * width];
        for (src, dst) in self
            .data
            .chunks_exact(self.width * 3)
            .zip(rows.chunks_exact_mut(3 * width))
        {
            for (x, &(x0, a0, a1)) in xs.iter().enumerate() {
                let x0 = x0 as usize;
                for c in 0..3 {
                    let a = i64::from(src[x0 * 3 + c]);
                    dst[c * width + x] = if x0 + 1 >= self.width {
                        a * COEF_ONE
                    } else {
                        a * a0 + i64::from(src[(x0 + 1) * 3 + c]) * a1
                    };
                }
            }
        }
        let row = |i: i64| i.clamp(0, self.height as i64 - 1) as usize;
        for (y, &(y0, b0, b1)) in ys.iter().enumerate() {
            let (r0, r1) = (row(y0), row(y0 + 1));
            for c in 0..3 {
                let s0 = &rows[(r0 * 3 + c) * width..][..width];
                let s1 = &rows[(r1 * 3 + c) * width..][..width];
                for (x, (a, b)) in s0.iter().zip(s1).enumerate() {
                    let v = (((a >> 4) * b0) >> 16) + (((b >> 4) * b1) >> 16);
                    put(x, y, c, ((v + 2) >> 2).clamp(0, 255) as f32);
                }
            }
        }
    }

    /// The quadrilateral `corners` (top-left, top-right, bottom-right, bottom-left) warped to
    /// an upright `width` x `height` image, as `cv2.warpPerspective` with INTER_CUBIC and
    /// BORDER_REPLICATE does.
    pub fn warp(&self, corners: &[[f64; 2]; 4], width: usize, height: usize) -> Bgr {
        let (w, h) = (width as f64, height as f64);
        let upright = [[0.0, 0.0], [w, 0.0], [w, h], [0.0, h]];
        // As cv2.warpPerspective: the forward map inverted, so output pixels map back here.
        let m = perspective_transform(corners, &upright)
            .and_then(|forward| invert3(&forward))
            .unwrap_or([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]);
        let weights = cubic_weights();
        let mut data = vec![0u8; width * height * 3];
        let clamp = |v: i64, n: usize| v.clamp(0, n as i64 - 1) as usize;
        // OpenCV maps in blocks (BLOCK_SZ 32), adding each column's offset to its block's
        // start: the same sums in the same order give the same roundings.
        let bh0 = (BLOCK / 2).min(height).max(1);
        let bw0 = (BLOCK * BLOCK / bh0).min(width).max(1);
        for x in (0..width).step_by(bw0) {
            for y in 0..height {
                let (xb, yf) = (x as f64, y as f64);
                let x0 = m[0] * xb + m[1] * yf + m[2];
                let y0 = m[3] * xb + m[4] * yf + m[5];
                let w0 = m[6] * xb + m[7] * yf + m[8];
                for x1 in 0..bw0.min(width - x) {
                    let xf = x1 as f64;
                    let d = w0 + m[6] * xf;
                    let scale = if d != 0.0 { TAB_SIZE as f64 / d } else { 0.0 };
                    // The source position in 1/32 pixels, rounded to nearest: its integer
                    // part picks the 4x4 neighbourhood, its fraction the weights.
                    let at = |v: f64| {
                        (v * scale)
                            .clamp(f64::from(i32::MIN), f64::from(i32::MAX))
                            .round_ties_even() as i64
                    };
                    let sx = at(x0 + m[0] * xf);
                    let sy = at(y0 + m[3] * xf);
                    let taps = &weights
                        [((sy & (TAB_SIZE - 1)) * TAB_SIZE + (sx & (TAB_SIZE - 1))) as usize];
                    let (left, top) = ((sx >> TAB_BITS) - 1, (sy >> TAB_BITS) - 1);
                    let cols = [0, 1, 2, 3].map(|i| clamp(left + i, self.width));
                    let rows = [0, 1, 2, 3].map(|i| clamp(top + i, self.height));
                    for c in 0..3 {
                        let mut sum = 0i64;
                        for (j, row) in rows.iter().enumerate() {
                            for (i, col) in cols.iter().enumerate() {
                                let v = self.data[(row * self.width + col) * 3 + c];
                                sum += i64::from(v) * i64::from(taps[j * 4 + i]);
                            }
                        }
                        let v = (sum + (1 << (COEF_BITS - 1))) >> COEF_BITS;
                        data[(y * width + x + x1) * 3 + c] = v.clamp(0, 255) as u8;
                    }
                }
            }
        }
        Bgr {
            width,
            height,
            data,
        }
    }

    /// Rotated a quarter turn counter-clockwise (`np.rot90`).
    pub fn rotate_ccw(&self) -> Bgr {
        let (w, h) = (self.height, self.width);
        let mut data = vec![0u8; w * h * 3];
        for y in 0..h {
            for x in 0..w {
                let (sx, sy) = (self.width - 1 - y, x);
                let s = (sy * self.width + sx) * 3;
                data[(y * w + x) * 3..][..3].copy_from_slice(&self.data[s..s + 3]);
            }
        }
        Bgr {
            width: w,
            height: h,
            data,
        }
    }
}

/// Sub-pixel steps of OpenCV's interpolation tables (`INTER_TAB_SIZE`), and their bits.
const TAB_SIZE: i64 = 32;
const TAB_BITS: i64 = 5;
/// OpenCV's warp block size (`BLOCK_SZ` of its perspective warp).
const BLOCK: usize = 32;
/// Bits of OpenCV's fixed-point remap weights (`INTER_REMAP_COEF_BITS`).
const COEF_BITS: i64 = 15;

/// OpenCV's fixed-point bicubic weights (`initInterTab2D` for INTER_CUBIC): for each of
/// 32 x 32 sub-pixel positions (y major), the 4 x 4 weights, products of the float cubic
/// coefficients (a = -0.75) rounded to 15 bits, the rounding error put on the largest or
/// smallest of the central weights so that each set sums to exactly 1 << 15.
fn cubic_weights() -> &'static [[i32; 16]] {
    static TABLE: std::sync::OnceLock<Vec<[i32; 16]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let cubic = |x: f32| -> [f32; 4] {
            const A: f32 = -0.75;
            let c0 = ((A * (x + 1.0) - 5.0 * A) * (x + 1.0) + 8.0 * A) * (x + 1.0) - 4.0 * A;
            let c1 = ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0;
            let c2 = ((A + 2.0) * (1.0 - x) - (A + 3.0)) * (1.0 - x) * (1.0 - x) + 1.0;
            [c0, c1, c2, 1.0 - c0 - c1 - c2]
        };
        let one = 1i32 << COEF_BITS;
        let mut table = Vec::with_capacity((TAB_SIZE * TAB_SIZE) as usize);
        for i in 0..TAB_SIZE {
            let vy = cubic(1.0 / TAB_SIZE as f32 * i as f32);
            for j in 0..TAB_SIZE {
                let vx = cubic(1.0 / TAB_SIZE as f32 * j as f32);
                let mut w = [0i32; 16];
                for k1 in 0..4 {
                    for k2 in 0..4 {
                        w[k1 * 4 + k2] = (vy[k1] * vx[k2] * one as f32).round_ties_even() as i32;
                    }
                }
                let diff = w.iter().sum::<i32>() - one;
                if diff != 0 {
                    let (mut lo, mut hi) = (2 * 4 + 2, 2 * 4 + 2);
                    for k1 in 2..4 {
                        for k2 in 2..4 {
                            let k = k1 * 4 + k2;
                            if w[k] < w[lo] {
                                lo = k;
                            } else if w[k] > w[hi] {
                                hi = k;
                            }
                        }
                    }
                    if diff < 0 {
                        w[hi] -= diff;
                    } else {
                        w[lo] -= diff;
                    }
                }
                table.push(w);
            }
        }
        table
    })
}

/// One in OpenCV's 11-bit fixed-point resize weights (`INTER_RESIZE_COEF_SCALE`).
const COEF_ONE: i64 = 1 << 11;

/// For each of `dst` output positions, as OpenCV's INTER_LINEAR computes them: the first
/// source position and the two fixed-point weights (pixel centres aligned, the fraction in
/// float32). `clamp` (the horizontal pass) moves positions before the first or past the last
/// source pixel onto it with weights (1, 0); without it (the vertical pass) the position and
/// weights stay and only the rows read are clamped, as OpenCV does.
fn taps(dst: usize, src: usize, clamp: bool) -> Vec<(i64, i64, i64)> {
    let scale = 1.0 / (dst as f64 / src as f64);
    (0..dst)
        .map(|d| {
            let f = ((d as f64 + 0.5) * scale - 0.5) as f32;
            let mut s = f.floor() as i64;
            let mut f = f - s as f32;
            if clamp && s < 0 {
                (s, f) = (0, 0.0);
            }
            if clamp && s >= src as i64 - 1 {
                (s, f) = (src as i64 - 1, 0.0);
            }
            let weight = |v: f32| (v * COEF_ONE as f32).round_ties_even() as i64;
            (s, weight(1.0 - f), weight(f))
        })
        .collect()
}

/// The projective map taking `from[i]` to `to[i]`, row-major 3 x 3, as
/// `cv2.getPerspectiveTransform` computes it: the 8 x 8 system solved by OpenCV's LU
/// decomposition (partial pivoting, the same operations in the same order), so the matrix is
/// the reference's to the last bit. Points are float32, as OpenCV takes them.
fn perspective_transform(from: &[[f64; 2]; 4], to: &[[f64; 2]; 4]) -> Option<[f64; 9]> {
    let f32 = |v: f64| f64::from(v as f32);
    let mut a = [[0f64; 8]; 8];
    let mut b = [0f64; 8];
    for i in 0..4 {
        let ([x, y], [u, v]) = (from[i].map(f32), to[i].map(f32));
        a[i] = [x, y, 1.0, 0.0, 0.0, 0.0, -x * u, -y * u];
        a[i + 4] = [0.0, 0.0, 0.0, x, y, 1.0, -x * v, -y * v];
        b[i] = u;
        b[i + 4] = v;
    }
    for i in 0..8 {
        let mut k = i;
        for j in i + 1..8 {
            if a[j][i].abs() > a[k][i].abs() {
                k = j;
            }
        }
        if a[k][i].abs() < f64::EPSILON * 100.0 {
            return None;
        }
        a.swap(i, k);
        b.swap(i, k);
        let d = -1.0 / a[i][i];
        let pivot = a[i];
        for j in i + 1..8 {
            let alpha = a[j][i] * d;
            for (v, p) in a[j][i + 1..].iter_mut().zip(&pivot[i + 1..]) {
                *v += alpha * p;
            }
            b[j] += alpha * b[i];
        }
    }
    for i in (0..8).rev() {
        // Subtracted one term at a time, in OpenCV's order.
        let s = a[i][i + 1..]
            .iter()
            .zip(&b[i + 1..])
            .fold(b[i], |s, (x, y)| s - x * y);
        b[i] = s / a[i][i];
    }
    Some([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], 1.0])
}

/// The inverse of a 3 x 3 matrix as `cv::invert` computes it for 3 x 3 (the adjugate over
/// the determinant).
fn invert3(m: &[f64; 9]) -> Option<[f64; 9]> {
    let s = |r: usize, c: usize| m[r * 3 + c];
    let det = s(0, 0) * (s(1, 1) * s(2, 2) - s(1, 2) * s(2, 1))
        - s(0, 1) * (s(1, 0) * s(2, 2) - s(1, 2) * s(2, 0))
        + s(0, 2) * (s(1, 0) * s(2, 1) - s(1, 1) * s(2, 0));
    if det == 0.0 {
        return None;
    }
    let d = 1.0 / det;
    Some([
        (s(1, 1) * s(2, 2) - s(1, 2) * s(2, 1)) * d,
        (s(0, 2) * s(2, 1) - s(0, 1) * s(2, 2)) * d,
        (s(0, 1) * s(1, 2) - s(0, 2) * s(1, 1)) * d,
        (s(1, 2) * s(2, 0) - s(1, 0) * s(2, 2)) * d,
        (s(0, 0) * s(2, 2) - s(0, 2) * s(2, 0)) * d,
        (s(0, 2) * s(1, 0) - s(0, 0) * s(1, 2)) * d,
        (s(1, 0) * s(2, 1) - s(1, 1) * s(2, 0)) * d,
        (s(0, 1) * s(2, 0) - s(0, 0) * s(2, 1)) * d,
        (s(0, 0) * s(1, 1) - s(0, 1) * s(1, 0)) * d,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resizing_aligns_pixel_centres_like_opencv_and_pads_the_canvas() {
        // cv2.resize of the row [0, 100] to 4 pixels gives [0, 25, 75, 100].
        let img = Bgr {
            width: 2,
            height: 1,
            data: vec![0, 0, 0, 100, 100, 100],
        };
        let mut out = vec![0u8; 3 * 6 * 4];
        img.resize_normalized(4, 1, 6, &mut out);
        let values: Vec<f32> = out
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let expected: Vec<f32> = [0.0, 25.0, 75.0, 100.0]
            .iter()
            .map(|v| v / 127.5 - 1.0)
            .collect();
        for plane in values.chunks_exact(6) {
            assert_eq!(&plane[..4], &expected[..]);
            assert_eq!(&plane[4..], &[0.0, 0.0], "padding stays zero");
        }
    }

    #[test]
    fn an_upright_integer_box_warps_to_an_exact_copy() {
        let data: Vec<u8> = (0..6 * 5 * 3).map(|v| (v * 7 % 256) as u8).collect();
        let img = Bgr {
            width: 6,
            height: 5,
            data,
        };
        let crop = img.warp(&[[1.0, 1.0], [4.0, 1.0], [4.0, 3.0], [1.0, 3.0]], 3, 2);
        for y in 0..2 {
            for x in 0..3 {
                for c in 0..3 {
                    assert_eq!(
                        crop.data[(y * 3 + x) * 3 + c],
                        img.data[((y + 1) * 6 + x + 1) * 3 + c]
                    );
                }
            }
        }
    }
}
