//! Noise schedules and sampler steps as diffusers computes them (`EulerDiscreteScheduler`,
//! `DDIMScheduler`; epsilon prediction, SD 1.x's `scaled_linear` betas), in `f32` with the
//! operations in diffusers' order so that a loop here follows diffusers' loop on the same
//! model outputs to float rounding.

/// The training noise schedule a scheduler is built from.
#[derive(Debug, Clone, Copy)]
pub struct Betas {
    /// First beta (SD 1.x: 0.00085).
    pub start: f32,
    /// Last beta (SD 1.x: 0.012).
    pub end: f32,
    /// Training timesteps (1000).
    pub train_steps: usize,
    /// `scaled_linear` (linear in sqrt(beta), SD's) or `linear`.
    pub scaled: bool,
}

impl Betas {
    /// `alphas_cumprod`: the product of (1 - beta) up to each training timestep.
    pub fn alphas_cumprod(&self) -> Vec<f32> {
        let (a, b) = if self.scaled {
            (self.start.sqrt(), self.end.sqrt())
        } else {
            (self.start, self.end)
        };
        let n = self.train_steps;
        let step = (b - a) / (n.max(2) - 1) as f32;
        // torch.linspace: from the start for the first half, from the end for the second.
        let betas = (0..n).map(|i| {
            let v = if i < n / 2 {
                a + step * i as f32
            } else {
                b - step * (n - 1 - i) as f32
            };
            if self.scaled {
                v * v
            } else {
                v
            }
        });
        let mut product = 1.0f32;
        betas
            .map(|beta| {
                product *= 1.0 - beta;
                product
            })
            .collect()
    }
}

/// How the sampling timesteps are spread over the training ones (diffusers'
/// `timestep_spacing`, with `steps_offset` for `leading`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spacing {
    /// Evenly from T-1 down to 0, fractional (Euler) or rounded (DDIM).
    Linspace,
    /// Multiples of T / steps from 0, plus the offset.
    Leading(usize),
    /// Multiples of T / steps from T, minus one.
    Trailing,
}

impl Spacing {
    /// The timesteps, last-trained first; `round` rounds linspace's (DDIM's integer steps).
    fn timesteps(self, train_steps: usize, steps: usize, round: bool) -> Vec<f32> {
        let last = (train_steps - 1) as f64;
        match self {
            Spacing::Linspace => (0..steps)
                .map(|i| {
                    let t = if steps == 1 {
                        0.0
                    } else {
                        last * i as f64 / (steps - 1) as f64
                    };
                    // NumPy rounds half to even.
                    if round {
                        t.round_ties_even() as f32
                    } else {
                        t as f32
                    }
                })
                .rev()
                .collect(),
            Spacing::Leading(offset) => {
                let ratio = train_steps / steps;
                (0..steps)
                    .rev()
                    .map(|i| (i * ratio + offset) as f32)
                    .collect()
            }
            Spacing::Trailing => {
                let ratio = train_steps as f64 / steps as f64;
                (0..steps)
                    .map(|i| (train_steps as f64 - ratio * i as f64).round_ties_even() as f32 - 1.0)
                    .collect()
            }
        }
    }
}

/// One sampling schedule: the UNet's timesteps and what each step does with its output.
pub trait Scheduler {
    /// The timesteps to call the UNet at, in order.
    fn timesteps(&self) -> &[f32];
    /// How much the unit initial noise is scaled by.
    fn init_noise_sigma(&self) -> f32;
    /// The factor the UNet's input is multiplied by at step `i`.
    fn input_scale(&self, i: usize) -> f32;
    /// The sample after step `i`, from the sample and the (guided) noise prediction; steps
    /// are taken in order (a multistep sampler remembers the earlier ones).
    fn step(&mut self, i: usize, sample: &[f32], noise: &[f32]) -> Vec<f32>;
    /// The clean latents the model predicts at step `i` (what a preview shows).
    fn denoised(&self, i: usize, sample: &[f32], noise: &[f32]) -> Vec<f32>;
}

/// x0 = x - sigma * eps, for the samplers that scale noise by sigma.
fn denoised_at(sigma: f32, sample: &[f32], noise: &[f32]) -> Vec<f32> {
    sample
        .iter()
        .zip(noise)
        .map(|(&x, &eps)| x - sigma * eps)
        .collect()
}

/// The sigma schedule Euler and LMS share in diffusers: the timesteps, the noise level at each
/// (the training sigmas interpolated linearly, `np.interp` in f64) and a final zero.
struct SigmaSchedule {
    timesteps: Vec<f32>,
    sigmas: Vec<f32>,
    spacing: Spacing,
}

impl SigmaSchedule {
    fn new(betas: &Betas, steps: usize, spacing: Spacing) -> Self {
        let train_sigmas: Vec<f32> = betas
            .alphas_cumprod()
            .iter()
            .map(|&ac| ((1.0 - ac) / ac).sqrt())
            .collect();
        let timesteps = spacing.timesteps(betas.train_steps, steps, false);
        let last = train_sigmas.len() - 1;
        let mut sigmas: Vec<f32> = timesteps
            .iter()
            .map(|&t| {
                let t = f64::from(t);
                let low = (t.floor() as usize).min(last);
                let high = (low + 1).min(last);
                let w = t - low as f64;
                (f64::from(train_sigmas[low]) * (1.0 - w) + f64::from(train_sigmas[high]) * w)
                    as f32
            })
            .collect();
        sigmas.push(0.0);
        Self {
            timesteps,
            sigmas,
            spacing,
        }
    }

    /// The largest sigma (with `leading` spacing, the noise of a sample at that sigma:
    /// sqrt(sigma² + 1)).
    fn init_noise_sigma(&self) -> f32 {
        let max = self.sigmas.iter().copied().fold(0.0, f32::max);
        match self.spacing {
            Spacing::Linspace | Spacing::Trailing => max,
            Spacing::Leading(_) => (max * max + 1.0).sqrt(),
        }
    }

    /// 1 / sqrt(sigma² + 1) at step `i`.
    fn input_scale(&self, i: usize) -> f32 {
        let sigma = self.sigmas[i];
        1.0 / (sigma * sigma + 1.0).sqrt()
    }
}

/// diffusers' `EulerDiscreteScheduler` (final sigma zero, no churn; SD's configuration spaces
/// it `linspace`).
pub struct Euler(SigmaSchedule);

impl Euler {
    /// The schedule for `steps` sampling steps.
    pub fn new(betas: &Betas, steps: usize, spacing: Spacing) -> Self {
        Self(SigmaSchedule::new(betas, steps, spacing))
    }
}

impl Scheduler for Euler {
    fn timesteps(&self) -> &[f32] {
        &self.0.timesteps
    }

    fn init_noise_sigma(&self) -> f32 {
        self.0.init_noise_sigma()
    }

    fn input_scale(&self, i: usize) -> f32 {
        self.0.input_scale(i)
    }

    fn denoised(&self, i: usize, sample: &[f32], noise: &[f32]) -> Vec<f32> {
        denoised_at(self.0.sigmas[i], sample, noise)
    }

    fn step(&mut self, i: usize, sample: &[f32], noise: &[f32]) -> Vec<f32> {
        let sigma = self.0.sigmas[i];
        let dt = self.0.sigmas[i + 1] - sigma;
        sample
            .iter()
            .zip(noise)
            .map(|(&x, &eps)| {
                let original = x - sigma * eps;
                let derivative = (x - original) / sigma;
                x + derivative * dt
            })
            .collect()
    }
}

/// diffusers' `LMSDiscreteScheduler` (order 4; the schedule is Euler's): each step moves
/// along a polynomial through the last four derivatives, whose coefficients diffusers
/// integrates numerically; here they are integrated exactly (Gauss–Legendre, exact for the
/// cubic Lagrange basis).
pub struct Lms {
    schedule: SigmaSchedule,
    derivatives: std::collections::VecDeque<Vec<f32>>,
}

/// The linear multistep method's order.
const LMS_ORDER: usize = 4;

impl Lms {
    /// The schedule for `steps` sampling steps.
    pub fn new(betas: &Betas, steps: usize, spacing: Spacing) -> Self {
        Self {
            schedule: SigmaSchedule::new(betas, steps, spacing),
            derivatives: std::collections::VecDeque::with_capacity(LMS_ORDER + 1),
        }
    }

    /// The integral over [sigma_t, sigma_t+1] of the Lagrange basis polynomial of
    /// `current` among the last `order` sigmas.
    fn coefficient(&self, order: usize, t: usize, current: usize) -> f64 {
        let sigmas = &self.schedule.sigmas;
        let sigma = |k: usize| f64::from(sigmas[t - k]);
        let basis = |tau: f64| {
            (0..order)
                .filter(|&k| k != current)
                .map(|k| (tau - sigma(k)) / (sigma(current) - sigma(k)))
                .product::<f64>()
        };
        let (a, b) = (f64::from(sigmas[t]), f64::from(sigmas[t + 1]));
        let (mid, half) = ((a + b) / 2.0, (b - a) / 2.0);
        let node = (3.0f64 / 5.0).sqrt();
        half * (5.0 / 9.0 * basis(mid - half * node)
            + 8.0 / 9.0 * basis(mid)
            + 5.0 / 9.0 * basis(mid + half * node))
    }
}

impl Scheduler for Lms {
    fn timesteps(&self) -> &[f32] {
        &self.schedule.timesteps
    }

    fn init_noise_sigma(&self) -> f32 {
        self.schedule.init_noise_sigma()
    }

    fn input_scale(&self, i: usize) -> f32 {
        self.schedule.input_scale(i)
    }

    fn denoised(&self, i: usize, sample: &[f32], noise: &[f32]) -> Vec<f32> {
        denoised_at(self.schedule.sigmas[i], sample, noise)
    }

    fn step(&mut self, i: usize, sample: &[f32], noise: &[f32]) -> Vec<f32> {
        let sigma = self.schedule.sigmas[i];
        let derivative: Vec<f32> = sample
            .iter()
            .zip(noise)
            .map(|(&x, &eps)| (x - (x - sigma * eps)) / sigma)
            .collect();
        self.derivatives.push_back(derivative);
        if self.derivatives.len() > LMS_ORDER {
            self.derivatives.pop_front();
        }
        let order = (i + 1).min(LMS_ORDER);
        let coefficients: Vec<f32> = (0..order)
            .map(|c| self.coefficient(order, i, c) as f32)
            .collect();
        // Newest derivative first, summed in diffusers' order.
        let newest = self.derivatives.len() - 1;
        sample
            .iter()
            .enumerate()
            .map(|(j, &x)| {
                let sum = coefficients
                    .iter()
                    .enumerate()
                    .fold(0.0f32, |acc, (c, &k)| {
                        acc + k * self.derivatives[newest - c][j]
                    });
                x + sum
            })
            .collect()
    }
}

/// diffusers' `DDIMScheduler` with eta 0 (deterministic). SD 1.x's configuration:
/// `leading` spacing with `steps_offset` 1, no `clip_sample`, `set_alpha_to_one` off.
pub struct Ddim {
    timesteps: Vec<f32>,
    alphas_cumprod: Vec<f32>,
    ratio: usize,
    final_alpha: f32,
    clip_sample: bool,
}

impl Ddim {
    /// The schedule for `steps` sampling steps (1 ≤ steps ≤ training steps).
    pub fn new(
        betas: &Betas,
        steps: usize,
        spacing: Spacing,
        clip_sample: bool,
        set_alpha_to_one: bool,
    ) -> Self {
        let alphas_cumprod = betas.alphas_cumprod();
        let final_alpha = if set_alpha_to_one {
            1.0
        } else {
            alphas_cumprod[0]
        };
        Self {
            timesteps: spacing.timesteps(betas.train_steps, steps, true),
            alphas_cumprod,
            ratio: betas.train_steps / steps.max(1),
            final_alpha,
            clip_sample,
        }
    }
}

impl Ddim {
    /// alphas_cumprod at step `i`'s timestep.
    fn alpha(&self, i: usize) -> f32 {
        let last = self.alphas_cumprod.len() - 1;
        self.alphas_cumprod[(self.timesteps[i] as usize).min(last)]
    }
}

impl Scheduler for Ddim {
    fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f32 {
        1.0
    }

    fn input_scale(&self, _i: usize) -> f32 {
        1.0
    }

    fn denoised(&self, i: usize, sample: &[f32], noise: &[f32]) -> Vec<f32> {
        let alpha = self.alpha(i);
        let beta = 1.0 - alpha;
        sample
            .iter()
            .zip(noise)
            .map(|(&x, &eps)| (x - beta.sqrt() * eps) / alpha.sqrt())
            .collect()
    }

    fn step(&mut self, i: usize, sample: &[f32], noise: &[f32]) -> Vec<f32> {
        let t = self.timesteps[i] as usize;
        let last = self.alphas_cumprod.len() - 1;
        let alpha = self.alphas_cumprod[t.min(last)];
        // The previous timestep is `ratio` earlier whatever the spacing, as in diffusers.
        let alpha_prev = t
            .checked_sub(self.ratio)
            .map_or(self.final_alpha, |p| self.alphas_cumprod[p.min(last)]);
        let beta = 1.0 - alpha;
        sample
            .iter()
            .zip(noise)
            .map(|(&x, &eps)| {
                // x0 may be clipped; the noise stays the model's (use_clipped_model_output off).
                let mut original = (x - beta.sqrt() * eps) / alpha.sqrt();
                if self.clip_sample {
                    original = original.clamp(-1.0, 1.0);
                }
                let direction = (1.0 - alpha_prev).sqrt() * eps;
                alpha_prev.sqrt() * original + direction
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SD: Betas = Betas {
        start: 0.00085,
        end: 0.012,
        train_steps: 1000,
        scaled: true,
    };

    #[test]
    fn euler_matches_diffusers_schedule() {
        // diffusers 0.42, EulerDiscreteScheduler(0.00085, 0.012, "scaled_linear"),
        // set_timesteps(4): timesteps [999, 666, 333, 0], sigmas[0] 14.6146, init 14.6146.
        let e = Euler::new(&SD, 4, Spacing::Linspace);
        assert_eq!(e.timesteps(), &[999.0, 666.0, 333.0, 0.0]);
        assert!((e.init_noise_sigma() - 14.6146).abs() < 1e-3);
        let sigmas = &e.0.sigmas;
        assert_eq!(sigmas.len(), 5);
        assert_eq!(sigmas[4], 0.0);
        assert!((sigmas[3] - 0.0292).abs() < 1e-3, "{}", sigmas[3]);
    }

    #[test]
    fn lms_first_coefficients_are_eulers_step() {
        // Order 1: the basis is 1, its integral the step in sigma.
        let l = Lms::new(&SD, 10, Spacing::Linspace);
        let sigmas = &l.schedule.sigmas;
        let step = f64::from(sigmas[1]) - f64::from(sigmas[0]);
        assert!((l.coefficient(1, 0, 0) - step).abs() < 1e-9);
        // The coefficients of one step sum to the step (the basis sums to 1).
        let sum: f64 = (0..3).map(|c| l.coefficient(3, 4, c)).sum();
        let step = f64::from(sigmas[5]) - f64::from(sigmas[4]);
        assert!((sum - step).abs() < 1e-9, "{sum} vs {step}");
    }

    #[test]
    fn spacings_match_diffusers() {
        // DDIMScheduler.set_timesteps(4) with each timestep_spacing (steps_offset 1).
        let leading = Ddim::new(&SD, 4, Spacing::Leading(1), false, false);
        assert_eq!(leading.timesteps(), &[751.0, 501.0, 251.0, 1.0]);
        let linspace = Ddim::new(&SD, 30, Spacing::Linspace, false, false);
        assert_eq!(&linspace.timesteps()[..3], &[999.0, 965.0, 930.0]);
        let trailing = Ddim::new(&SD, 3, Spacing::Trailing, false, false);
        assert_eq!(trailing.timesteps(), &[999.0, 666.0, 332.0]);
    }
}
