//! 8-bit BGR images and the two OpenCV operations PP-OCR's reference pipeline applies to them:
//! `cv2.resize` (bilinear, pixel centres aligned, no anti-aliasing) and `cv2.warpPerspective`
//! (bicubic, a = -0.75, replicated border). Floating point here, so values can differ from
//! OpenCV's fixed-point arithmetic by one 8-bit step.

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

    fn at(&self, x: usize, y: usize, c: usize) -> f32 {
        f32::from(self.data[(y * self.width + x) * 3 + c])
    }

    /// `cv2.resize(img, (width, height))` with INTER_LINEAR.
    pub fn resize(&self, width: usize, height: usize) -> Bgr {
        let taps = |dst: usize, src: usize| -> Vec<(usize, usize, f32)> {
            let scale = src as f64 / dst as f64;
            (0..dst)
                .map(|d| {
                    let f = (d as f64 + 0.5) * scale - 0.5;
                    let mut i = f.floor();
                    let mut w = f - i;
                    if i < 0.0 {
                        i = 0.0;
                        w = 0.0;
                    }
                    let i = i as usize;
                    if i + 1 >= src {
                        (src - 1, src - 1, 0.0)
                    } else {
                        (i, i + 1, w as f32)
                    }
                })
                .collect()
        };
        let xs = taps(width, self.width);
        let ys = taps(height, self.height);
        let mut data = vec![0u8; width * height * 3];
        for (y, &(y0, y1, wy)) in ys.iter().enumerate() {
            for (x, &(x0, x1, wx)) in xs.iter().enumerate() {
                for c in 0..3 {
                    let top = self.at(x0, y0, c) * (1.0 - wx) + self.at(x1, y0, c) * wx;
                    let bottom = self.at(x0, y1, c) * (1.0 - wx) + self.at(x1, y1, c) * wx;
                    let v = top * (1.0 - wy) + bottom * wy;
                    data[(y * width + x) * 3 + c] = v.round().clamp(0.0, 255.0) as u8;
                }
            }
        }
        Bgr {
            width,
            height,
            data,
        }
    }

    /// The quadrilateral `corners` (top-left, top-right, bottom-right, bottom-left) warped to
    /// an upright `width` x `height` image, as `cv2.warpPerspective` with INTER_CUBIC and
    /// BORDER_REPLICATE does.
    pub fn warp(&self, corners: &[[f64; 2]; 4], width: usize, height: usize) -> Bgr {
        let (w, h) = (width as f64, height as f64);
        let upright = [[0.0, 0.0], [w, 0.0], [w, h], [0.0, h]];
        // Maps output pixels back into this image.
        let m = homography(&upright, corners).unwrap_or([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]);
        let mut data = vec![0u8; width * height * 3];
        let cubic = |t: f64| -> [f64; 4] {
            const A: f64 = -0.75;
            let w0 = ((A * (t + 1.0) - 5.0 * A) * (t + 1.0) + 8.0 * A) * (t + 1.0) - 4.0 * A;
            let w1 = ((A + 2.0) * t - (A + 3.0)) * t * t + 1.0;
            let w2 = ((A + 2.0) * (1.0 - t) - (A + 3.0)) * (1.0 - t) * (1.0 - t) + 1.0;
            [w0, w1, w2, 1.0 - w0 - w1 - w2]
        };
        let clamp = |v: i64, n: usize| v.clamp(0, n as i64 - 1) as usize;
        for y in 0..height {
            for x in 0..width {
                let (xf, yf) = (x as f64, y as f64);
                let d = m[6] * xf + m[7] * yf + 1.0;
                let sx = (m[0] * xf + m[1] * yf + m[2]) / d;
                let sy = (m[3] * xf + m[4] * yf + m[5]) / d;
                let (ix, iy) = (sx.floor(), sy.floor());
                let (wx, wy) = (cubic(sx - ix), cubic(sy - iy));
                for c in 0..3 {
                    let mut v = 0.0;
                    for (j, wyj) in wy.iter().enumerate() {
                        let row = clamp(iy as i64 - 1 + j as i64, self.height);
                        for (i, wxi) in wx.iter().enumerate() {
                            let col = clamp(ix as i64 - 1 + i as i64, self.width);
                            v += wyj * wxi * f64::from(self.data[(row * self.width + col) * 3 + c]);
                        }
                    }
                    data[(y * width + x) * 3 + c] = v.round().clamp(0.0, 255.0) as u8;
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

    /// Planar CHW floats, `(v / 255 - 0.5) / 0.5`, into a `width`-wide canvas (zero padding on
    /// the right), as PP-OCR normalises its inputs.
    pub fn normalized_chw(&self, canvas_width: usize, out: &mut [f32]) {
        let plane = canvas_width * self.height;
        for y in 0..self.height {
            for x in 0..self.width.min(canvas_width) {
                for c in 0..3 {
                    out[c * plane + y * canvas_width + x] = self.at(x, y, c) / 255.0 * 2.0 - 1.0;
                }
            }
        }
    }
}

/// The projective map taking `from[i]` to `to[i]` (`cv2.getPerspectiveTransform`), as
/// [a, b, c, d, e, f, g, h] with x' = (ax + by + c) / (gx + hy + 1), y' = (dx + ey + f) / (...).
fn homography(from: &[[f64; 2]; 4], to: &[[f64; 2]; 4]) -> Option<[f64; 8]> {
    let mut a = [[0f64; 9]; 8];
    for i in 0..4 {
        let ([x, y], [u, v]) = (from[i], to[i]);
        a[i] = [x, y, 1.0, 0.0, 0.0, 0.0, -x * u, -y * u, u];
        a[i + 4] = [0.0, 0.0, 0.0, x, y, 1.0, -x * v, -y * v, v];
    }
    // Gaussian elimination with partial pivoting.
    for col in 0..8 {
        let pivot = (col..8).max_by(|&p, &q| a[p][col].abs().total_cmp(&a[q][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        let pivot_row = a[col];
        for (row, r) in a.iter_mut().enumerate() {
            if row != col {
                let f = r[col] / pivot_row[col];
                for (v, p) in r.iter_mut().zip(&pivot_row).skip(col) {
                    *v -= f * p;
                }
            }
        }
    }
    let mut m = [0f64; 8];
    for (i, v) in m.iter_mut().enumerate() {
        *v = a[i][8] / a[i][i];
    }
    Some(m)
}

#[cfg(test)]
mod tests {
    use super::*;

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
