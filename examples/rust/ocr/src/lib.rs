//! Reads the text in an image with PaddleOCR's PP-OCRv4 models, the way the
//! `rapidocr-onnxruntime` package does (its defaults, without the angle classifier): the
//! stage decodes the image, sizes it for the detector and calls `ocr_det` through the server,
//! finds the text boxes in the probability map (boxes.rs), crops each box upright, sends the
//! crops to `ocr_rec` in batches of similar widths, and decodes the recogniser's CTC output
//! with the character set shipped beside `model.wasm` (`ppocr_keys.txt`).
//!
//! One image per request: `IMAGE` (BYTES [1], PNG or JPEG) → `TEXTS` (BYTES [n]), `BOXES`
//! (INT32 [n, 4, 2], corners clockwise from top-left, in image pixels), `SCORES` (FP32 [n]),
//! in reading order; lines scoring below `text_score` are left out.

mod boxes;
mod pixels;

use boxes::{DbParams, ProbMap};
use pixels::Bgr;
use wasmtron_guest::{
    export_stage, host, read_model_file, Config, Datatype, Error, Request, Result, Stage, Tensor,
};

const REC_HEIGHT: usize = 48;
const REC_MIN_RATIO: f64 = 320.0 / 48.0;

struct Ocr {
    det_model: String,
    rec_model: String,
    /// Index 0 is the CTC blank; then the model's characters, then a space.
    characters: Vec<String>,
    limit_side_len: usize,
    /// rapidocr's page geometry: very large or very small pages are rescaled, very flat ones
    /// get black bands above and below before detection.
    max_side_len: usize,
    min_side_len: usize,
    min_height: usize,
    width_height_ratio: f64,
    db: DbParams,
    text_score: f32,
    rec_batch: usize,
}

impl Stage for Ocr {
    fn init(config: &Config) -> Result<Self> {
        let keys_file = config
            .parameter("characters_file")
            .unwrap_or("ppocr_keys.txt");
        let keys = String::from_utf8(read_model_file(keys_file)?)
            .map_err(|e| Error::invalid(format!("'{keys_file}' is not UTF-8: {e}")))?;
        let mut characters = vec![String::new()];
        characters.extend(keys.split('\n').map(str::to_owned));
        characters.push(" ".into());
        Ok(Self {
            det_model: config.parameter("det_model").unwrap_or("ocr_det").into(),
            rec_model: config.parameter("rec_model").unwrap_or("ocr_rec").into(),
            characters,
            limit_side_len: config.parameter_or("limit_side_len", 736)?,
            max_side_len: config.parameter_or("max_side_len", 2000)?,
            min_side_len: config.parameter_or("min_side_len", 30)?,
            min_height: config.parameter_or("min_height", 30)?,
            width_height_ratio: config.parameter_or("width_height_ratio", 8.0)?,
            db: DbParams {
                thresh: config.parameter_or("thresh", 0.3)?,
                box_thresh: config.parameter_or("box_thresh", 0.5)?,
                unclip_ratio: config.parameter_or("unclip_ratio", 1.6)?,
                max_candidates: config.parameter_or("max_candidates", 1000)?,
            },
            text_score: config.parameter_or("text_score", 0.5)?,
            rec_batch: config.parameter_or("rec_batch", 6usize)?.max(1),
        })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let input = request.input("IMAGE")?;
        let elements = input.bytes_elements()?;
        let [bytes] = elements.as_slice() else {
            return Err(Error::invalid(format!(
                "IMAGE must hold one image, got {}",
                elements.len()
            )));
        };
        let decoded = image::load_from_memory(bytes)
            .map_err(|e| Error::invalid(format!("IMAGE is not a PNG or JPEG image: {e}")))?
            .to_rgb8();
        let (w, h) = (decoded.width() as usize, decoded.height() as usize);
        let page = self.prepare(Bgr::from_rgb(w, h, decoded.as_raw()));
        let boxes = self.detect(&page.image)?;
        let crops: Vec<Bgr> = boxes.iter().map(|b| crop(&page.image, b)).collect();
        let read = self.recognize(&crops)?;
        let mut texts = Vec::new();
        let mut corners = Vec::new();
        let mut scores = Vec::new();
        for (b, (text, score)) in boxes.iter().zip(read) {
            if score >= self.text_score {
                texts.push(text);
                // Back to the caller's pixels: undo the bands, then the rescaling.
                corners.extend(b.iter().flat_map(|p| {
                    let x = (p[0] * page.ratio_w).clamp(0.0, w as f64);
                    let y = ((p[1] - page.top as f64) * page.ratio_h).clamp(0.0, h as f64);
                    [x.round() as i32, y.round() as i32]
                }));
                scores.push(score);
            }
        }
        let n = texts.len() as i64;
        request.select(vec![
            Tensor::from_bytes_elements("TEXTS", &[n], texts.iter().map(String::as_bytes)),
            Tensor::from_i32("BOXES", &[n, 4, 2], &corners),
            Tensor::from_f32("SCORES", &[n], &scores),
        ])
    }
}

/// The page as the detector sees it, and how to map its pixels back.
struct Page {
    image: Bgr,
    /// Rows of black added above (and below) the page.
    top: usize,
    ratio_w: f64,
    ratio_h: f64,
}

/// Both sides scaled by `ratio`, then rounded to multiples of 32 (rapidocr's
/// `reduce_max_side` / `increase_min_side`).
fn rescaled(image: &Bgr, ratio: f64) -> Bgr {
    let side = |v: usize| {
        (((v as f64 * ratio).trunc() / 32.0).round_ties_even() * 32.0).max(32.0) as usize
    };
    image.resize(side(image.width), side(image.height))
}

impl Ocr {
    /// rapidocr's geometry before detection: a page longer than `max_side_len` is scaled
    /// down, one shorter than `min_side_len` up; one at most `min_height` tall or more than
    /// `width_height_ratio` times wider than tall gets black bands above and below.
    fn prepare(&self, mut image: Bgr) -> Page {
        let (w, h) = (image.width, image.height);
        let (mut ratio_w, mut ratio_h) = (1.0, 1.0);
        let longest = w.max(h);
        if longest > self.max_side_len {
            image = rescaled(&image, self.max_side_len as f64 / longest as f64);
            (ratio_w, ratio_h) = (
                w as f64 / image.width as f64,
                h as f64 / image.height as f64,
            );
        }
        let shortest = image.width.min(image.height);
        if shortest < self.min_side_len {
            let (w, h) = (image.width, image.height);
            image = rescaled(&image, self.min_side_len as f64 / shortest as f64);
            (ratio_w, ratio_h) = (
                w as f64 / image.width as f64,
                h as f64 / image.height as f64,
            );
        }
        let (w, h) = (image.width, image.height);
        let mut top = 0;
        if h <= self.min_height || w as f64 / h as f64 > self.width_height_ratio {
            let banded = ((w as f64 / self.width_height_ratio) as usize).max(self.min_height) * 2;
            top = banded.abs_diff(h) / 2;
            image = image.with_bands(top);
        }
        Page {
            image,
            top,
            ratio_w,
            ratio_h,
        }
    }

    /// The detector's input size: the shorter side brought up to `limit_side_len`, each side
    /// then rounded to a multiple of 32 (rapidocr's `DetPreProcess` with `limit_type: min`).
    fn detector_size(&self, w: usize, h: usize) -> (usize, usize) {
        let limit = self.limit_side_len as f64;
        let ratio = if (w.min(h) as f64) < limit {
            limit / w.min(h) as f64
        } else {
            1.0
        };
        let side = |v: usize| {
            let scaled = (v as f64 * ratio).trunc();
            ((scaled / 32.0).round_ties_even() * 32.0) as usize
        };
        (side(w).max(32), side(h).max(32))
    }

    fn detect(&self, image: &Bgr) -> Result<Vec<[boxes::Point; 4]>> {
        let (dw, dh) = self.detector_size(image.width, image.height);
        let mut x = vec![0u8; 3 * dw * dh * 4];
        image.resize_normalized(dw, dh, dw, &mut x);
        let x = Tensor {
            name: "x".into(),
            datatype: Datatype::Fp32,
            shape: vec![1, 3, dh as i64, dw as i64],
            data: x,
        };
        let outputs = host::infer(&self.det_model, None, &[x], &[])?;
        let map = outputs.first().ok_or_else(|| {
            Error::internal(format!("model '{}' returned no output", self.det_model))
        })?;
        let values = map.to_f32()?;
        if values.len() != dw * dh {
            return Err(Error::internal(format!(
                "model '{}' returned {} values for a {dw}x{dh} map",
                self.det_model,
                values.len()
            )));
        }
        let map = ProbMap {
            width: dw,
            height: dh,
            values: &values,
        };
        Ok(boxes::detect(&map, &self.db, image.width, image.height))
    }

    /// Text and mean confidence of each crop, in the crops' order. Crops go to the recogniser
    /// sorted by width/height, `rec_batch` at a time, each batch as wide as its widest crop.
    fn recognize(&self, crops: &[Bgr]) -> Result<Vec<(String, f32)>> {
        let ratio = |c: &Bgr| c.width as f64 / c.height as f64;
        let mut order: Vec<usize> = (0..crops.len()).collect();
        order.sort_by(|&a, &b| ratio(&crops[a]).total_cmp(&ratio(&crops[b])));
        let mut read = vec![(String::new(), 0.0); crops.len()];
        for batch in order.chunks(self.rec_batch) {
            let max_ratio = batch
                .iter()
                .map(|&i| ratio(&crops[i]))
                .fold(REC_MIN_RATIO, f64::max);
            let width = (REC_HEIGHT as f64 * max_ratio) as usize;
            let plane = 3 * REC_HEIGHT * width;
            let mut x = vec![0u8; batch.len() * plane * 4];
            for (slot, &i) in batch.iter().enumerate() {
                let resized_w =
                    ((REC_HEIGHT as f64 * ratio(&crops[i])).ceil() as usize).clamp(1, width);
                crops[i].resize_normalized(
                    resized_w,
                    REC_HEIGHT,
                    width,
                    &mut x[slot * plane * 4..][..plane * 4],
                );
            }
            let x = Tensor {
                name: "x".into(),
                datatype: Datatype::Fp32,
                shape: vec![batch.len() as i64, 3, REC_HEIGHT as i64, width as i64],
                data: x,
            };
            let outputs = host::infer(&self.rec_model, None, &[x], &[])?;
            let probs = outputs.first().ok_or_else(|| {
                Error::internal(format!("model '{}' returned no output", self.rec_model))
            })?;
            if probs.datatype != Datatype::Fp32 || probs.shape.len() != 3 {
                return Err(Error::internal(format!(
                    "model '{}' returned {:?} {:?}, expected FP32 [N, T, classes]",
                    self.rec_model, probs.datatype, probs.shape
                )));
            }
            let (steps, classes) = (probs.shape[1] as usize, probs.shape[2] as usize);
            let values = probs.to_f32()?;
            for (slot, &i) in batch.iter().enumerate() {
                read[i] = self.ctc_decode(
                    &values[slot * steps * classes..][..steps * classes],
                    classes,
                );
            }
        }
        Ok(read)
    }

    /// Greedy CTC: the best class per step, repeats merged, blanks dropped; the confidence is
    /// the mean probability of the characters kept (0 for none).
    fn ctc_decode(&self, probs: &[f32], classes: usize) -> (String, f32) {
        let mut text = String::new();
        let mut kept = Vec::new();
        let mut previous = usize::MAX;
        for step in probs.chunks_exact(classes) {
            let (best, p) =
                step.iter().enumerate().fold(
                    (0, f32::MIN),
                    |acc, (i, &v)| if v > acc.1 { (i, v) } else { acc },
                );
            if best != 0 && best != previous {
                text.push_str(self.characters.get(best).map_or("", String::as_str));
                kept.push(p);
            }
            previous = best;
        }
        let score = if kept.is_empty() {
            0.0
        } else {
            kept.iter().sum::<f32>() / kept.len() as f32
        };
        (text, score)
    }
}

/// The box cut out upright (rapidocr's `get_rotate_crop_image`), turned a quarter when it
/// is much taller than wide.
fn crop(image: &Bgr, b: &[boxes::Point; 4]) -> Bgr {
    let dist =
        |p: boxes::Point, q: boxes::Point| ((p[0] - q[0]).powi(2) + (p[1] - q[1]).powi(2)).sqrt();
    let width = dist(b[0], b[1]).max(dist(b[2], b[3])) as usize;
    let height = dist(b[0], b[3]).max(dist(b[1], b[2])) as usize;
    let out = image.warp(b, width.max(1), height.max(1));
    if out.height as f64 / out.width as f64 >= 1.5 {
        out.rotate_ccw()
    } else {
        out
    }
}

export_stage!(Ocr);
