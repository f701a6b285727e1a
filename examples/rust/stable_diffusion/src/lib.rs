//! Text to image: the Stable Diffusion loop that Triton's examples run in a Python-backend
//! model, as a Wasm stage. The stage tokenizes the prompt with CLIP's BPE (the
//! `tokenizer.json` shipped beside `model.wasm`), encodes the prompt and the negative prompt
//! with the `text_encoder` model in one batch of two, starts from seeded (or given) latents,
//! and runs the sampler: each step calls the `unet` model once on the unconditional and the
//! conditional half together, mixes them with the guidance scale (classifier-free guidance)
//! and takes a scheduler step computed as diffusers computes it (`scheduler.rs`: Euler, LMS,
//! DDIM). The `vae`
//! model decodes the final latents, and the image leaves as `generated_image`, uint8
//! [1, H, W, 3]. The models run on the server (ONNX Runtime; on a GPU host its CUDA or
//! TensorRT provider); the stage only holds the loop.
//!
//! Inputs: `prompt` (BYTES [1]), optional `negative_prompt`, `steps`, `guidance_scale`,
//! `seed`, `height`, `width`, `latents` (FP32 [4, H/8, W/8]: the unit initial noise, instead
//! of the seed's), `stream_every`. A decoupled configuration (`stable_diffusion_stream`)
//! answers a preview every `stream_every` steps (the VAE's image of the clean latents the
//! model predicts at that step, with `step` saying which), then the final image. Parameters (config.pbtxt): the defaults of those (`steps`,
//! `guidance_scale`, `image_height`, `image_width`, `seed`), `scheduler` (`euler`, `lms` or
//! `ddim`) with diffusers' settings of it (`timestep_spacing`, `steps_offset`, `clip_sample`,
//! `set_alpha_to_one`; SD 1.x's by default), the three model names, and the noise schedule
//! (`beta_start`, `beta_end`, `beta_schedule`, `num_train_timesteps`, `vae_scaling_factor`).

mod scheduler;

use rand::SeedableRng;
use rand_distr::{Distribution, StandardNormal};
use scheduler::{Betas, Ddim, Euler, Lms, Scheduler, Spacing};
use tokenizers::{PaddingParams, PaddingStrategy, Tokenizer, TruncationParams};
use wasmtron_guest::{
    export_stage, host, read_model_file, Config, Error, Request, Result, Stage, Tensor,
};

/// CLIP's context length: prompts are padded and truncated to it, as SD's pipelines do.
const MAX_LENGTH: usize = 77;
/// How much the VAE upsamples the latents (SD: 8).
const VAE_SCALE: usize = 8;
/// The latents' channels.
const LATENT_CHANNELS: usize = 4;
/// The most sampling steps a request may ask for.
const MAX_STEPS: usize = 500;

/// The sampler, with its settings (diffusers' scheduler configuration).
#[derive(Clone, Copy, PartialEq, Eq)]
enum SchedulerKind {
    Euler(Spacing),
    Lms(Spacing),
    Ddim {
        spacing: Spacing,
        clip_sample: bool,
        set_alpha_to_one: bool,
    },
}

impl SchedulerKind {
    /// From the `scheduler`, `timestep_spacing`, `steps_offset`, `clip_sample` and
    /// `set_alpha_to_one` parameters; the defaults are SD 1.x's scheduler configuration.
    fn from_config(config: &Config) -> Result<Self> {
        let kind = config.parameter("scheduler").unwrap_or("euler").trim();
        let ddim = match kind {
            "" | "euler" | "lms" => false,
            "ddim" => true,
            other => {
                return Err(Error::invalid(format!(
                    "parameter 'scheduler' is '{other}'; one of euler, lms, ddim"
                )))
            }
        };
        let offset = config.parameter_or("steps_offset", 1usize)?;
        let default = if ddim { "leading" } else { "linspace" };
        let spacing = match config
            .parameter("timestep_spacing")
            .unwrap_or(default)
            .trim()
        {
            "linspace" => Spacing::Linspace,
            "leading" => Spacing::Leading(offset),
            "trailing" => Spacing::Trailing,
            other => {
                return Err(Error::invalid(format!(
                    "parameter 'timestep_spacing' is '{other}'; one of linspace, leading, trailing"
                )))
            }
        };
        Ok(if ddim {
            SchedulerKind::Ddim {
                spacing,
                clip_sample: config.parameter_or("clip_sample", false)?,
                set_alpha_to_one: config.parameter_or("set_alpha_to_one", false)?,
            }
        } else if kind == "lms" {
            SchedulerKind::Lms(spacing)
        } else {
            SchedulerKind::Euler(spacing)
        })
    }
}

struct StableDiffusion {
    tokenizer: Tokenizer,
    text_encoder: String,
    unet: String,
    vae: String,
    betas: Betas,
    scheduler: SchedulerKind,
    vae_scaling_factor: f32,
    steps: usize,
    guidance_scale: f32,
    height: usize,
    width: usize,
    max_side: usize,
    seed: Option<u64>,
    /// Decoupled models: a preview every this many steps (0: none), `stream_every`.
    stream_every: usize,
    /// Whether the model is decoupled (may answer more than once).
    decoupled: bool,
}

impl Stage for StableDiffusion {
    fn init(config: &Config) -> Result<Self> {
        let file = config
            .parameter("tokenizer_file")
            .unwrap_or("tokenizer.json");
        let mut tokenizer = Tokenizer::from_bytes(read_model_file(file)?)
            .map_err(|e| Error::invalid(format!("'{file}' is not a tokenizer.json: {e}")))?;
        let pad_id = tokenizer
            .token_to_id("<|endoftext|>")
            .ok_or_else(|| Error::invalid(format!("'{file}' has no <|endoftext|> token")))?;
        tokenizer.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::Fixed(MAX_LENGTH),
            pad_id,
            pad_token: "<|endoftext|>".into(),
            ..PaddingParams::default()
        }));
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: MAX_LENGTH,
                ..TruncationParams::default()
            }))
            .map_err(|e| Error::invalid(format!("'{file}': {e}")))?;
        let scheduler = SchedulerKind::from_config(config)?;
        let scaled = match config.parameter("beta_schedule").unwrap_or("scaled_linear") {
            "scaled_linear" => true,
            "linear" => false,
            other => {
                return Err(Error::invalid(format!(
                    "parameter 'beta_schedule' is '{other}'; one of scaled_linear, linear"
                )))
            }
        };
        let betas = Betas {
            start: config.parameter_or("beta_start", 0.00085f32)?,
            end: config.parameter_or("beta_end", 0.012f32)?,
            train_steps: config.parameter_or("num_train_timesteps", 1000usize)?,
            scaled,
        };
        if betas.train_steps < 2 || !(0.0..1.0).contains(&betas.start) {
            return Err(Error::invalid(
                "parameters 'num_train_timesteps' (≥ 2) and 'beta_start' (in [0, 1)) are out of range",
            ));
        }
        let seed = match config.parameter("seed").map(str::trim) {
            None | Some("") => None,
            Some(text) => Some(text.parse().map_err(|e| {
                Error::invalid(format!("parameter 'seed' is not a whole number: {e}"))
            })?),
        };
        let name = |key: &str| config.parameter(key).unwrap_or(key).to_owned();
        let decoupled = serde_json::from_str::<serde_json::Value>(&config.json)
            .ok()
            .and_then(|c| c["model_transaction_policy"]["decoupled"].as_bool())
            .unwrap_or(false);
        Ok(Self {
            tokenizer,
            text_encoder: name("text_encoder"),
            unet: name("unet"),
            vae: name("vae"),
            betas,
            scheduler,
            vae_scaling_factor: config.parameter_or("vae_scaling_factor", 0.18215f32)?,
            steps: config.parameter_or("steps", 50usize)?,
            guidance_scale: config.parameter_or("guidance_scale", 7.5f32)?,
            height: config.parameter_or("image_height", 512usize)?,
            width: config.parameter_or("image_width", 512usize)?,
            max_side: config.parameter_or("max_image_side", 1024usize)?,
            seed,
            stream_every: config.parameter_or("stream_every", 0usize)?,
            decoupled,
        })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        let prompt = request.scalar_text("prompt")?.unwrap_or_default();
        let negative = request.scalar_text("negative_prompt")?.unwrap_or_default();
        let steps = match request.scalar_i64("steps")? {
            None => self.steps,
            Some(n) if (1..=MAX_STEPS as i64).contains(&n) => n as usize,
            Some(n) => {
                return Err(Error::invalid(format!(
                    "input 'steps' is {n}; it must be between 1 and {MAX_STEPS}"
                )))
            }
        };
        let guidance = match request.scalar_f32("guidance_scale")? {
            None => self.guidance_scale,
            Some(g) if g.is_finite() && (0.0..=100.0).contains(&g) => g,
            Some(g) => {
                return Err(Error::invalid(format!(
                    "input 'guidance_scale' is {g}; it must be between 0 and 100"
                )))
            }
        };
        let stream_every = match request.scalar_i64("stream_every")? {
            None => self.stream_every,
            Some(n) if n >= 0 && self.decoupled => n as usize,
            Some(n) if n >= 0 => {
                return Err(Error::invalid(
                    "input 'stream_every' needs a decoupled model (model_transaction_policy                      { decoupled: true }): this one answers once",
                ))
            }
            Some(n) => {
                return Err(Error::invalid(format!(
                    "input 'stream_every' is {n}; it must be 0 (no previews) or more"
                )))
            }
        };
        let height = self.side(request, "height", self.height)?;
        let width = self.side(request, "width", self.width)?;
        let (h, w) = (height / VAE_SCALE, width / VAE_SCALE);
        let size = LATENT_CHANNELS * h * w;
        let noise = match request.input("latents") {
            Ok(t) => {
                let values = t.to_f32().map_err(|e| named("latents", e))?;
                if values.len() != size || values.iter().any(|v| !v.is_finite()) {
                    return Err(Error::invalid(format!(
                        "input 'latents' must hold {LATENT_CHANNELS}×{h}×{w} finite values for a \
                         {height}×{width} image, got shape {:?}",
                        t.shape
                    )));
                }
                values
            }
            Err(_) => {
                let seed = match request.scalar_i64("seed")? {
                    Some(s) => Some(s as u64),
                    None => self.seed,
                };
                let mut rng = match seed {
                    Some(s) => rand_chacha::ChaCha8Rng::seed_from_u64(s),
                    None => rand_chacha::ChaCha8Rng::from_os_rng(),
                };
                (0..size).map(|_| StandardNormal.sample(&mut rng)).collect()
            }
        };

        // Classifier-free guidance, as diffusers: only when the scale is above 1; the
        // unconditional (negative) prompt first.
        let guided = guidance > 1.0;
        let texts = if guided {
            vec![negative, prompt]
        } else {
            vec![prompt]
        };
        let rows = texts.len();
        let encodings = self
            .tokenizer
            .encode_batch(texts, true)
            .map_err(|e| Error::invalid(format!("input 'prompt': {e}")))?;
        let ids: Vec<i64> = encodings
            .iter()
            .flat_map(|e| e.get_ids().iter().map(|&id| i64::from(id)))
            .collect();
        let ids = Tensor::from_i64("input_ids", &[rows as i64, MAX_LENGTH as i64], &ids);
        let mut context = take(
            host::infer(&self.text_encoder, None, &[ids], &["last_hidden_state"])?,
            &self.text_encoder,
            "last_hidden_state",
        )?;
        context.name = "encoder_hidden_states".into();

        let mut scheduler: Box<dyn Scheduler> = match self.scheduler {
            SchedulerKind::Euler(spacing) => Box::new(Euler::new(&self.betas, steps, spacing)),
            SchedulerKind::Lms(spacing) => Box::new(Lms::new(&self.betas, steps, spacing)),
            SchedulerKind::Ddim {
                spacing,
                clip_sample,
                set_alpha_to_one,
            } => Box::new(Ddim::new(
                &self.betas,
                steps,
                spacing,
                clip_sample,
                set_alpha_to_one,
            )),
        };
        let sigma = scheduler.init_noise_sigma();
        let mut latents: Vec<f32> = noise.iter().map(|v| v * sigma).collect();
        let shape = [rows as i64, LATENT_CHANNELS as i64, h as i64, w as i64];
        let timesteps = scheduler.timesteps().to_vec();
        for (i, &t) in timesteps.iter().enumerate() {
            let scale = scheduler.input_scale(i);
            let scaled: Vec<f32> = latents.iter().map(|v| v * scale).collect();
            let sample: Vec<f32> = (0..rows).flat_map(|_| scaled.iter().copied()).collect();
            let outputs = host::infer(
                &self.unet,
                None,
                &[
                    Tensor::from_f32("sample", &shape, &sample),
                    Tensor::from_f32("timestep", &[rows as i64], &vec![t; rows]),
                    context.clone(),
                ],
                &["out_sample"],
            )?;
            let predicted = take(outputs, &self.unet, "out_sample")?.to_f32()?;
            if predicted.len() != rows * size {
                return Err(Error::internal(format!(
                    "model '{}' answered {} values for {} latents",
                    self.unet,
                    predicted.len(),
                    rows * size
                )));
            }
            let noise: Vec<f32> = if guided {
                let (uncond, cond) = predicted.split_at(size);
                uncond
                    .iter()
                    .zip(cond)
                    .map(|(&u, &c)| u + guidance * (c - u))
                    .collect()
            } else {
                predicted
            };
            // A preview of what the model sees now, every `stream_every` steps but the last.
            if self.decoupled && stream_every > 0 && (i + 1) % stream_every == 0 && i + 1 < steps {
                let preview =
                    self.decode(&scheduler.denoised(i, &latents, &noise), height, width)?;
                host::respond(&request.select(image_outputs(&preview, height, width, i + 1))?)?;
            }
            latents = scheduler.step(i, &latents, &noise);
        }

        let image = self.decode(&latents, height, width)?;
        let outputs = request.select(image_outputs(&image, height, width, steps))?;
        if self.decoupled {
            // The last response of a decoupled request, then the end of it.
            host::respond(&outputs)?;
            return Ok(Vec::new());
        }
        Ok(outputs)
    }
}

/// The outputs of one image: `generated_image` [1, H, W, 3] and `step` (the steps it took).
fn image_outputs(image: &[u8], height: usize, width: usize, step: usize) -> Vec<Tensor> {
    vec![
        Tensor::from_u8(
            "generated_image",
            &[1, height as i64, width as i64, 3],
            image,
        ),
        Tensor::from_i32("step", &[1, 1], &[step as i32]),
    ]
}

impl StableDiffusion {
    /// Latents to an image with the VAE: [-1, 1] CHW -> [0, 255] HWC, rounded as diffusers
    /// hands images to Pillow.
    fn decode(&self, latents: &[f32], height: usize, width: usize) -> Result<Vec<u8>> {
        let (h, w) = (height / VAE_SCALE, width / VAE_SCALE);
        let scaled: Vec<f32> = latents
            .iter()
            .map(|v| v / self.vae_scaling_factor)
            .collect();
        let latent = Tensor::from_f32(
            "latent_sample",
            &[1, LATENT_CHANNELS as i64, h as i64, w as i64],
            &scaled,
        );
        let decoded = take(
            host::infer(&self.vae, None, &[latent], &["sample"])?,
            &self.vae,
            "sample",
        )?
        .to_f32()?;
        if decoded.len() != 3 * height * width {
            return Err(Error::internal(format!(
                "model '{}' answered {} values for a {height}×{width} image",
                self.vae,
                decoded.len()
            )));
        }
        let plane = height * width;
        let mut image = vec![0u8; 3 * plane];
        for (p, pixel) in image.chunks_exact_mut(3).enumerate() {
            for (c, value) in pixel.iter_mut().enumerate() {
                let x = (decoded[c * plane + p] / 2.0 + 0.5).clamp(0.0, 1.0);
                *value = (x * 255.0).round() as u8;
            }
        }
        Ok(image)
    }

    /// An image side from the request (or the default), checked.
    fn side(&self, request: &Request, input: &str, default: usize) -> Result<usize> {
        let side = match request.scalar_i64(input)? {
            None => return Ok(default),
            Some(v) => v,
        };
        if side < VAE_SCALE as i64 || side > self.max_side as i64 || side % VAE_SCALE as i64 != 0 {
            return Err(Error::invalid(format!(
                "input '{input}' is {side}; it must be a multiple of {VAE_SCALE} between \
                 {VAE_SCALE} and {}",
                self.max_side
            )));
        }
        Ok(side as usize)
    }
}

/// An error about an input, naming it.
fn named(input: &str, e: Error) -> Error {
    Error::invalid(format!("input '{input}': {}", e.message))
}

/// The named output of a model's answer.
fn take(outputs: Vec<Tensor>, model: &str, name: &str) -> Result<Tensor> {
    outputs
        .into_iter()
        .find(|t| t.name == name)
        .ok_or_else(|| Error::internal(format!("model '{model}' answered no '{name}'")))
}

export_stage!(StableDiffusion);
