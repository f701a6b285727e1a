//! Terrain heightmaps from a real diffusion model: adaptive-terrain-diffusion's consistency
//! UNet (served as `terrain_unet`: `noisy` [B, 1, 128, 128], `sigma` [B], `difficulty` [B]
//! → `denoised`), driven by the multistep consistency sampler (Song et al., 2023). Step one
//! denoises pure noise at `sigma_max` in one call, exactly as the package's own generator does;
//! each further step puts noise back at a lower sigma (Karras spacing, rho 7) and denoises
//! again, trading calls for detail. Heights leave in metres, from the model's asinh-compressed
//! [-1, 1] space, with the lowest point at zero (the package's `zero_floor`).
//!
//! Inputs: `difficulty` (INT32 [1], 1–100, the terrain's roughness class), optional `seed`,
//! `steps` (1–8, default 1), `noise` (FP32 [steps, 128, 128]: the unit noise of each step,
//! instead of the seed's). Outputs: `heightmap` (FP32 [128, 128], metres) and `image` (UINT8
//! [128, 128], the heights as grey levels over the model's height range).

use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};
use wasmtron_guest::{export_stage, host, Config, Error, Request, Result, Stage, Tensor};

/// The model's native side.
const SIDE: usize = 128;
/// Difficulty classes the model was trained on.
const CLASSES: i64 = 100;
/// The most sampling steps a request may ask for.
const MAX_STEPS: usize = 8;

struct Terrain {
    unet: String,
    sigma_min: f32,
    sigma_max: f32,
    height_range: f32,
    asinh_scale: f32,
    rho: f32,
}

impl Stage for Terrain {
    fn init(config: &Config) -> Result<Self> {
        let terrain = Self {
            unet: config
                .parameter("unet")
                .unwrap_or("terrain_unet")
                .to_owned(),
            sigma_min: config.parameter_or("sigma_min", 0.002f32)?,
            sigma_max: config.parameter_or("sigma_max", 80.0f32)?,
            height_range: config.parameter_or("height_range", 22.168_64f32)?,
            asinh_scale: config.parameter_or("asinh_scale", 0.1f32)?,
            rho: config.parameter_or("rho", 7.0f32)?,
        };
        if !(terrain.sigma_min > 0.0 && terrain.sigma_max > terrain.sigma_min) {
            return Err(Error::invalid(
                "parameters 'sigma_min' and 'sigma_max' must satisfy 0 < sigma_min < sigma_max",
            ));
        }
        Ok(terrain)
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let difficulty = request
            .scalar_i64("difficulty")?
            .ok_or_else(|| Error::invalid("missing input 'difficulty' (1 to 100)"))?;
        if !(1..=CLASSES).contains(&difficulty) {
            return Err(Error::invalid(format!(
                "input 'difficulty' is {difficulty}; it must be between 1 and {CLASSES}"
            )));
        }
        let steps = match request.scalar_i64("steps")? {
            None => 1,
            Some(n) if (1..=MAX_STEPS as i64).contains(&n) => n as usize,
            Some(n) => {
                return Err(Error::invalid(format!(
                    "input 'steps' is {n}; it must be between 1 and {MAX_STEPS}"
                )))
            }
        };
        let plane = SIDE * SIDE;
        let noise = match request.input("noise") {
            Ok(t) => {
                let values = t
                    .to_f32()
                    .map_err(|e| Error::invalid(format!("input 'noise': {}", e.message)))?;
                if values.len() != steps * plane || values.iter().any(|v| !v.is_finite()) {
                    return Err(Error::invalid(format!(
                        "input 'noise' must hold {steps}×{SIDE}×{SIDE} finite values (one plane \
                         per step), got shape {:?}",
                        t.shape
                    )));
                }
                values
            }
            Err(_) => {
                let mut rng = match request.scalar_i64("seed")? {
                    Some(s) => rand_chacha::ChaCha8Rng::seed_from_u64(s as u64),
                    None => rand_chacha::ChaCha8Rng::from_os_rng(),
                };
                (0..steps * plane)
                    .map(|_| StandardNormal.sample(&mut rng))
                    .collect()
            }
        };
        // The class as the model takes it: (d - 1) / 99.
        let label = ((difficulty - 1) as f32) / ((CLASSES - 1) as f32);
        let sigmas = self.sigmas(steps);
        let mut x = Vec::new();
        for (i, (&sigma, z)) in sigmas.iter().zip(noise.chunks_exact(plane)).enumerate() {
            let noisy: Vec<f32> = if i == 0 {
                z.iter().map(|v| v * sigma).collect()
            } else {
                let scale = (sigma * sigma - self.sigma_min * self.sigma_min).sqrt();
                x.iter().zip(z).map(|(xv, zv)| xv + scale * zv).collect()
            };
            x = self.denoise(&noisy, sigma, label)?;
        }
        let heights = self.heights(&x);
        let image: Vec<u8> = heights
            .iter()
            .map(|h| ((h / self.height_range).clamp(0.0, 1.0) * 255.0).round() as u8)
            .collect();
        let side = SIDE as i64;
        request.select(vec![
            Tensor::from_f32("heightmap", &[side, side], &heights),
            Tensor::from_u8("image", &[side, side], &image),
        ])
    }
}

impl Terrain {
    /// The sampler's noise levels: `sigma_max`, then Karras-spaced levels towards
    /// `sigma_min` (which is not itself a step).
    fn sigmas(&self, steps: usize) -> Vec<f32> {
        let (hi, lo) = (
            self.sigma_max.powf(1.0 / self.rho),
            self.sigma_min.powf(1.0 / self.rho),
        );
        (0..steps)
            .map(|i| (hi + (i as f32 / steps as f32) * (lo - hi)).powf(self.rho))
            .collect()
    }

    /// One call of the consistency model: the clean estimate of `noisy` at `sigma`.
    fn denoise(&self, noisy: &[f32], sigma: f32, label: f32) -> Result<Vec<f32>> {
        let side = SIDE as i64;
        let outputs = host::infer(
            &self.unet,
            None,
            &[
                Tensor::from_f32("noisy", &[1, 1, side, side], noisy),
                Tensor::from_f32("sigma", &[1], &[sigma]),
                Tensor::from_f32("difficulty", &[1], &[label]),
            ],
            &["denoised"],
        )?;
        let denoised = outputs
            .into_iter()
            .find(|t| t.name == "denoised")
            .ok_or_else(|| {
                Error::internal(format!("model '{}' answered no 'denoised'", self.unet))
            })?
            .to_f32()?;
        if denoised.len() != noisy.len() {
            return Err(Error::internal(format!(
                "model '{}' answered {} values for {}",
                self.unet,
                denoised.len(),
                noisy.len()
            )));
        }
        Ok(denoised)
    }

    /// Model space ([-1, 1], asinh-compressed) to metres, lowest point at zero, as the
    /// package's `_from_model_space(..., zero_floor=True)`.
    fn heights(&self, values: &[f32]) -> Vec<f32> {
        let normalizer = (self.height_range / self.asinh_scale).asinh();
        let mut heights: Vec<f32> = values
            .iter()
            .map(|v| {
                let unit = ((v + 1.0) * 0.5).clamp(0.0, 1.0);
                (self.asinh_scale * (unit * normalizer).sinh()).clamp(0.0, self.height_range)
            })
            .collect();
        let floor = heights.iter().copied().fold(f32::INFINITY, f32::min);
        for h in &mut heights {
            *h -= floor;
        }
        heights
    }
}

export_stage!(Terrain);
