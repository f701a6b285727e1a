//! Preprocessing stage: decodes PNG or JPEG bytes (`IMAGE`, BYTES [batch, 1]), resizes to
//! `size`×`size` and normalises with `mean`/`std` into the CHW layout image classifiers
//! expect (`PIXELS`, FP32 [batch, 3, size, size]). Parameters in config.pbtxt: `size`
//! (default 224), `mean` and `std` (three comma-separated values, default ImageNet's), and
//! `host_ops` (default "true"): decode, resize and normalise with the host's tensor
//! operations (`wasmtron_guest::ops`, native code, results equal to Pillow's) or, with
//! "false", inside the component (the `image` crate and `resize.rs`; kept for comparison in
//! benches/wasm_stage.rs).

mod resize;

use wasmtron_guest::{export_stage, ops, Config, Error, Request, Result, Stage, Tensor};

struct Preprocess {
    size: u32,
    mean: [f32; 3],
    std: [f32; 3],
    host_ops: bool,
}

fn triple(config: &Config, key: &str, default: [f32; 3]) -> Result<[f32; 3]> {
    let Some(text) = config.parameter(key) else {
        return Ok(default);
    };
    let values: Vec<f32> = text
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    <[f32; 3]>::try_from(values).map_err(|_| {
        Error::invalid(format!(
            "parameter '{key}' needs three numbers, got \"{text}\""
        ))
    })
}

impl Stage for Preprocess {
    fn init(config: &Config) -> Result<Self> {
        let size = match config.parameter("size") {
            Some(v) => v.trim().parse().map_err(|_| {
                Error::invalid(format!("parameter 'size' must be an integer, got \"{v}\""))
            })?,
            None => 224,
        };
        if size == 0 {
            return Err(Error::invalid("parameter 'size' must be at least 1"));
        }
        Ok(Preprocess {
            size,
            mean: triple(config, "mean", [0.485, 0.456, 0.406])?,
            std: triple(config, "std", [0.229, 0.224, 0.225])?,
            host_ops: config.parameter_or("host_ops", true)?,
        })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        if self.host_ops {
            return self.execute_on_host(request);
        }
        let images = request.input("IMAGE")?.bytes_elements()?;
        let side = self.size as usize;
        let plane = side * side;
        let mut pixels = vec![0f32; images.len() * 3 * plane];
        for (n, bytes) in images.iter().enumerate() {
            let decoded = image::load_from_memory(bytes).map_err(|e| {
                Error::invalid(format!("IMAGE[{n}] is not a PNG or JPEG image: {e}"))
            })?;
            let rgb = decoded.into_rgb8();
            if rgb.width() == 0 || rgb.height() == 0 {
                return Err(Error::invalid(format!("IMAGE[{n}] has no pixels")));
            }
            resize::resize_normalized(
                rgb.as_raw(),
                rgb.width() as usize,
                rgb.height() as usize,
                side,
                self.mean,
                self.std,
                &mut pixels[n * 3 * plane..(n + 1) * 3 * plane],
            );
        }
        let shape = [images.len() as i64, 3, side as i64, side as i64];
        request.select(vec![Tensor::from_f32("PIXELS", &shape, &pixels)])
    }
}

impl Preprocess {
    /// The same work as host operations: the pixels never pass through the component.
    fn execute_on_host(&self, request: &Request) -> Result<Vec<Tensor>> {
        let count = request.input("IMAGE")?.element_count();
        let mut planes = Vec::with_capacity(count);
        for n in 0..count {
            let image = ops::decode_input_image("IMAGE", n as u32, ops::Color::Rgb, 0)
                .and_then(|image| ops::resize(&image, self.size, self.size, ops::Filter::Bilinear))
                .map_err(|e| Error::invalid(format!("IMAGE[{n}]: {}", e.message)))?;
            let pixels = ops::normalize(&image, 1.0 / 255.0, &self.mean, &self.std, -1)?;
            planes.push(ops::transpose(&pixels, &[2, 0, 1])?);
        }
        let planes: Vec<&ops::Array> = planes.iter().collect();
        ops::set_output("PIXELS", &ops::stack(&planes)?)?;
        Ok(request.select_set(Vec::new()))
    }
}

export_stage!(Preprocess);
