//! Image operations on HWC arrays: decoding, colour conversion, resizing, letterboxing, cropping.

use super::{array::count, invalid, resample, Array, Budget};
use crate::{error::Result, tensor::DataType};

/// Default refusal threshold of `decode-image` (pixels), Pillow's decompression-bomb limit
/// rounded down.
pub const DEFAULT_MAX_PIXELS: u64 = 40_000_000;

/// Pixel layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Color {
    /// Red, green, blue.
    Rgb,
    /// Blue, green, red.
    Bgr,
    /// Luma.
    Gray,
}

impl Color {
    fn channels(self) -> usize {
        match self {
            Color::Rgb | Color::Bgr => 3,
            Color::Gray => 1,
        }
    }
}

/// Resampling filters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    /// Nearest source pixel.
    Nearest,
    /// Triangle filter, antialiased when shrinking.
    Bilinear,
}

/// (height, width, channels) of an image array, checked.
fn dims(op: &str, image: &Array) -> Result<(usize, usize, usize)> {
    match image.shape.as_slice() {
        &[h, w, c] if c > 0 => Ok((h, w, c)),
        other => Err(invalid(
            op,
            format!("the image must be [height, width, channels], got shape {other:?}"),
        )),
    }
}

/// Pillow's ITU-R 601-2 luma in 16-bit fixed point: exactly `convert("L")`.
fn luma(r: u8, g: u8, b: u8) -> u8 {
    ((u32::from(r) * 19595 + u32::from(g) * 38470 + u32::from(b) * 7471 + 0x8000) >> 16) as u8
}

/// Decodes PNG or JPEG bytes into uint8 [height, width, channels of `color`].
pub fn decode_image(
    data: &[u8],
    color: Color,
    max_pixels: u64,
    budget: &mut Budget,
) -> Result<Array> {
    let op = "decode-image";
    let max_pixels = if max_pixels == 0 {
        DEFAULT_MAX_PIXELS
    } else {
        max_pixels
    };
    let reader = || {
        image::ImageReader::new(std::io::Cursor::new(data))
            .with_guessed_format()
            .map_err(|e| invalid(op, format!("cannot read the image: {e}")))
    };
    let format = reader()?.format();
    if !matches!(
        format,
        Some(image::ImageFormat::Png | image::ImageFormat::Jpeg)
    ) {
        return Err(invalid(op, "the data is not a PNG or JPEG image"));
    }
    let (width, height) = reader()?
        .into_dimensions()
        .map_err(|e| invalid(op, format!("cannot read the image header: {e}")))?;
    let pixels = u64::from(width) * u64::from(height);
    if pixels > max_pixels {
        return Err(invalid(
            op,
            format!("the image is {width}x{height} = {pixels} pixels, more than max-pixels {max_pixels}"),
        ));
    }
    if pixels == 0 {
        return Err(invalid(op, "the image has no pixels"));
    }
    let (h, w) = (height as usize, width as usize);
    // The decoder's own buffer (up to 8 bytes per pixel for 16-bit RGBA) and the result.
    let decode_bytes = h * w * 8;
    budget.take(op, decode_bytes + h * w * color.channels())?;
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(width);
    limits.max_image_height = Some(height);
    limits.max_alloc = Some(decode_bytes as u64 + (1 << 20));
    let mut decoder = reader()?;
    decoder.limits(limits);
    let decoded = decoder
        .decode()
        .map_err(|e| invalid(op, format!("cannot decode the image: {e}")))?;
    let data = match (color, decoded) {
        (Color::Gray, image::DynamicImage::ImageLuma8(gray)) => gray.into_raw(),
        (Color::Gray, other) => other
            .into_rgb8()
            .as_raw()
            .chunks_exact(3)
            .map(|p| luma(p[0], p[1], p[2]))
            .collect(),
        (Color::Rgb, other) => other.into_rgb8().into_raw(),
        (Color::Bgr, other) => {
            let mut raw = other.into_rgb8().into_raw();
            raw.chunks_exact_mut(3).for_each(|p| p.swap(0, 2));
            raw
        }
    };
    Ok(Array {
        datatype: DataType::Uint8,
        shape: vec![h, w, color.channels()],
        data,
    })
}

/// Converts a uint8 image between colours.
pub fn convert_color(image: &Array, from: Color, to: Color, budget: &mut Budget) -> Result<Array> {
    let op = "convert-color";
    let (h, w, c) = dims(op, image)?;
    if image.datatype != DataType::Uint8 {
        return Err(invalid(
            op,
            format!("the image must be UINT8, got {}", image.datatype),
        ));
    }
    if c != from.channels() {
        return Err(invalid(
            op,
            format!(
                "a {from:?} image has {} channels, this one has {c}",
                from.channels()
            ),
        ));
    }
    budget.take(op, h * w * to.channels())?;
    let px = image.data.chunks_exact(c);
    let data: Vec<u8> = match (from, to) {
        (a, b) if a == b => image.data.clone(),
        (Color::Rgb, Color::Bgr) | (Color::Bgr, Color::Rgb) => {
            px.flat_map(|p| [p[2], p[1], p[0]]).collect()
        }
        (Color::Rgb, Color::Gray) => px.map(|p| luma(p[0], p[1], p[2])).collect(),
        (Color::Bgr, Color::Gray) => px.map(|p| luma(p[2], p[1], p[0])).collect(),
        (Color::Gray, _) => px.flat_map(|p| [p[0]; 3]).collect(),
        _ => unreachable!("all pairs are covered above"),
    };
    Ok(Array {
        datatype: DataType::Uint8,
        shape: vec![h, w, to.channels()],
        data,
    })
}

/// Resizes an image to exactly `height` x `width`.
pub fn resize(
    image: &Array,
    height: u32,
    width: u32,
    filter: Filter,
    budget: &mut Budget,
) -> Result<Array> {
    resize_named(
        "resize",
        image,
        height as usize,
        width as usize,
        filter,
        budget,
    )
}

fn resize_named(
    op: &str,
    image: &Array,
    out_h: usize,
    out_w: usize,
    filter: Filter,
    budget: &mut Budget,
) -> Result<Array> {
    let (h, w, c) = dims(op, image)?;
    if out_h == 0 || out_w == 0 {
        return Err(invalid(
            op,
            format!("the target size {out_h}x{out_w} is empty"),
        ));
    }
    if h == 0 || w == 0 {
        return Err(invalid(op, "the image has no pixels"));
    }
    let elements = count(op, &[out_h, out_w, c])?;
    let out_bytes = budget.take_elements(op, elements, image.datatype)?;
    let data = match (filter, image.datatype) {
        (Filter::Nearest, dt) => {
            let size = dt.element_size().unwrap_or(1);
            resample::nearest(&image.data, (h, w, c), (out_h, out_w), size)
        }
        (Filter::Bilinear, DataType::Uint8) => {
            budget.take(op, h * out_w * c)?;
            resample::bilinear_u8(&image.data, (h, w, c), (out_h, out_w))
        }
        (Filter::Bilinear, DataType::Fp32) => {
            budget.take(op, (h * out_w * c + h * w * c) * 4)?;
            let values = image.to_f32();
            let out = resample::bilinear_f32(&values, (h, w, c), (out_h, out_w));
            out.iter().flat_map(|v| v.to_le_bytes()).collect()
        }
        (Filter::Bilinear, other) => {
            return Err(invalid(
                op,
                format!("bilinear resizing takes UINT8 or FP32 images, got {other} (cast first)"),
            ))
        }
    };
    debug_assert_eq!(data.len(), out_bytes);
    Ok(Array {
        datatype: image.datatype,
        shape: vec![out_h, out_w, c],
        data,
    })
}

/// Resizes so that the shorter side is `size`, keeping the aspect ratio.
pub fn resize_shorter_side(
    image: &Array,
    size: u32,
    filter: Filter,
    budget: &mut Budget,
) -> Result<Array> {
    let op = "resize-shorter-side";
    let (h, w, _) = dims(op, image)?;
    if h == 0 || w == 0 || size == 0 {
        return Err(invalid(op, "the image and the size must not be empty"));
    }
    let size = size as usize;
    let (out_h, out_w) = if w <= h {
        (((size as u128 * h as u128) / w as u128) as usize, size)
    } else {
        (size, ((size as u128 * w as u128) / h as u128) as usize)
    };
    resize_named(op, image, out_h, out_w, filter, budget)
}

/// Fits the image into `height` x `width`, keeping its aspect ratio, and pads with `pad`.
pub fn letterbox(
    image: &Array,
    height: u32,
    width: u32,
    filter: Filter,
    pad: f32,
    budget: &mut Budget,
) -> Result<Array> {
    let op = "letterbox";
    let (h, w, c) = dims(op, image)?;
    let (out_h, out_w) = (height as usize, width as usize);
    if h == 0 || w == 0 || out_h == 0 || out_w == 0 {
        return Err(invalid(
            op,
            "the image and the target size must not be empty",
        ));
    }
    let ratio = (out_h as f64 / h as f64).min(out_w as f64 / w as f64);
    let new_h = ((h as f64 * ratio).round() as usize).clamp(1, out_h);
    let new_w = ((w as f64 * ratio).round() as usize).clamp(1, out_w);
    let elements = count(op, &[out_h, out_w, c])?;
    budget.take_elements(op, elements, image.datatype)?;
    let inner = resize_named(op, image, new_h, new_w, filter, budget)?;
    let size = image.datatype.element_size().unwrap_or(1);
    let fill: Vec<u8> = match image.datatype {
        DataType::Uint8 => vec![pad.round().clamp(0.0, 255.0) as u8],
        DataType::Fp32 => pad.to_le_bytes().to_vec(),
        other => {
            return Err(invalid(
                op,
                format!("letterbox takes UINT8 or FP32 images, got {other}"),
            ))
        }
    };
    let mut data: Vec<u8> = fill.iter().copied().cycle().take(elements * size).collect();
    let (top, left) = ((out_h - new_h) / 2, (out_w - new_w) / 2);
    let row = new_w * c * size;
    for (y, line) in inner.data.chunks_exact(row).enumerate() {
        let at = ((top + y) * out_w + left) * c * size;
        data[at..at + row].copy_from_slice(line);
    }
    Ok(Array {
        datatype: image.datatype,
        shape: vec![out_h, out_w, c],
        data,
    })
}

/// The region whose top-left pixel is (`top`, `left`).
pub fn crop(
    image: &Array,
    top: u32,
    left: u32,
    height: u32,
    width: u32,
    budget: &mut Budget,
) -> Result<Array> {
    crop_named(
        "crop",
        image,
        top as usize,
        left as usize,
        height as usize,
        width as usize,
        budget,
    )
}

fn crop_named(
    op: &str,
    image: &Array,
    top: usize,
    left: usize,
    height: usize,
    width: usize,
    budget: &mut Budget,
) -> Result<Array> {
    let (h, w, c) = dims(op, image)?;
    if height == 0 || width == 0 || top + height > h || left + width > w {
        return Err(invalid(
            op,
            format!(
                "the region {height}x{width} at (top {top}, left {left}) is empty or outside the \
                 {h}x{w} image"
            ),
        ));
    }
    let size = image.datatype.element_size().unwrap_or(1);
    let elements = count(op, &[height, width, c])?;
    budget.take_elements(op, elements, image.datatype)?;
    let row = width * c * size;
    let mut data = Vec::with_capacity(elements * size);
    for y in top..top + height {
        let at = (y * w + left) * c * size;
        data.extend_from_slice(&image.data[at..at + row]);
    }
    Ok(Array {
        datatype: image.datatype,
        shape: vec![height, width, c],
        data,
    })
}

/// The centred `height` x `width` region.
pub fn center_crop(image: &Array, height: u32, width: u32, budget: &mut Budget) -> Result<Array> {
    let op = "center-crop";
    let (h, w, _) = dims(op, image)?;
    let (height, width) = (height as usize, width as usize);
    if height > h || width > w {
        return Err(invalid(
            op,
            format!("the crop {height}x{width} is larger than the {h}x{w} image"),
        ));
    }
    // torchvision: int(round((h - height) / 2)), Python rounding half to even.
    let offset =
        |total: usize, part: usize| ((total - part) as f64 / 2.0).round_ties_even() as usize;
    crop_named(
        op,
        image,
        offset(h, height),
        offset(w, width),
        height,
        width,
        budget,
    )
}
