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

    /// INTER_LINEAR resampling to `width` x `height`, each value rounded to 8 bits as
    /// OpenCV's output is, handed to `put(x, y, channel, value)`. Separable: each source row
    /// is interpolated horizontally once, then output rows blend two of those.
    fn resize_each(
        &self,
        width: usize,
        height: usize,
        mut put: impl FnMut(usize, usize, usize, f32),
    ) {
        let xs = taps(width, self.width);
        let ys = taps(height, self.height);
        let mut rows = vec![0f32; self.height * 3 * width];
        for (src, dst) in self
            .data
            .chunks_exact(self.width * 3)
            .zip(rows.chunks_exact_mut(3 * width))
        {
            for (x, &(x0, x1, wx)) in xs.iter().enumerate() {
                for c in 0..3 {
                    let (a, b) = (f32::from(src[x0 * 3 + c]), f32::from(src[x1 * 3 + c]));
                    dst[c * width + x] = a + (b - a) * wx;
                }
            }
        }
        for (y, &(y0, y1, wy)) in ys.iter().enumerate() {
            for c in 0..3 {
                let r0 = &rows[(y0 * 3 + c) * width..][..width];
                let r1 = &rows[(y1 * 3 + c) * width..][..width];
                for (x, (a, b)) in r0.iter().zip(r1).enumerate() {
                    put(x, y, c, (a + (b - a) * wy).round());
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
}

/// For each of `dst` output positions: the two source positions and the weight of the second,
/// with OpenCV's pixel-centre alignment and edge clamping.
fn taps(dst: usize, src: usize) -> Vec<(usize, usize, f32)> {
    let scale = src as f64 / dst as f64;
    (0..dst)
        .map(|d| {
            let f = (d as f64 + 0.5) * scale - 0.5;
            let (i, w) = if f < 0.0 {
                (0, 0.0)
            } else {
                (f.floor() as usize, f - f.floor())
            };
            if i + 1 >= src {
                (src - 1, src - 1, 0.0)
            } else {
                (i, i + 1, w as f32)
            }
        })
        .collect()
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
