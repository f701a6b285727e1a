//! Element-wise and reducing operations: cast, normalisation, softmax, sigmoid, argmax, top-k.

use super::{
    array::{read_f64, read_i128},
    axis_index, invalid, Array, Budget,
};
use crate::{error::Result, tensor::DataType};

/// A value read from an array: integers exactly, floats as f64.
#[derive(Clone, Copy)]
enum Num {
    Int(i128),
    Float(f64),
}

fn write(target: DataType, value: Num, out: &mut Vec<u8>) {
    macro_rules! int {
        ($t:ty) => {{
            let v: $t = match value {
                Num::Int(i) => i.clamp(<$t>::MIN as i128, <$t>::MAX as i128) as $t,
                // `as` truncates toward zero, saturates, and maps NaN to 0.
                Num::Float(f) => f as $t,
            };
            out.extend_from_slice(&v.to_le_bytes());
        }};
    }
    let float = match value {
        Num::Int(i) => i as f64,
        Num::Float(f) => f,
    };
    match target {
        DataType::Bool => out.push(u8::from(float != 0.0)),
        DataType::Uint8 => int!(u8),
        DataType::Int8 => int!(i8),
        DataType::Uint16 => int!(u16),
        DataType::Int16 => int!(i16),
        DataType::Uint32 => int!(u32),
        DataType::Int32 => int!(i32),
        DataType::Uint64 => int!(u64),
        DataType::Int64 => int!(i64),
        DataType::Fp16 => out.extend_from_slice(&half::f16::from_f64(float).to_le_bytes()),
        DataType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(float).to_le_bytes()),
        DataType::Fp32 => out.extend_from_slice(&(float as f32).to_le_bytes()),
        DataType::Fp64 => out.extend_from_slice(&float.to_le_bytes()),
        DataType::Bytes => {}
    }
}

/// Converts every element to `target`.
pub fn cast(a: &Array, target: DataType, budget: &mut Budget) -> Result<Array> {
    let op = "cast";
    if target == DataType::Bytes {
        return Err(invalid(op, "cannot cast to BYTES"));
    }
    budget.take_elements(op, a.len(), target)?;
    let data = match (a.datatype, target) {
        (from, to) if from == to => a.data.clone(),
        (DataType::Uint8, DataType::Fp32) => a
            .data
            .iter()
            .flat_map(|&v| f32::from(v).to_le_bytes())
            .collect(),
        (from, to) => {
            let mut out = Vec::with_capacity(a.len() * to.element_size().unwrap_or(1));
            for i in 0..a.len() {
                let value = match read_i128(from, &a.data, i) {
                    Some(v) => Num::Int(v),
                    None => Num::Float(read_f64(from, &a.data, i)),
                };
                write(to, value, &mut out);
            }
            out
        }
    };
    Ok(Array {
        datatype: target,
        shape: a.shape.clone(),
        data,
    })
}

/// (elements before the axis, along it, after it).
fn split(a: &Array, axis: usize) -> (usize, usize, usize) {
    let outer = a.shape[..axis].iter().product();
    let inner = a.shape[axis + 1..].iter().product();
    (outer, a.shape[axis], inner)
}

fn ensure_rank(op: &str, a: &Array) -> Result<()> {
    if a.shape.is_empty() {
        return Err(invalid(
            op,
            "the array is a scalar (rank 0); it needs an axis",
        ));
    }
    Ok(())
}

/// fp32 `(x * scale - mean[c]) / std[c]` with c the index along `axis`.
pub fn normalize(
    a: &Array,
    scale: f32,
    mean: &[f32],
    std: &[f32],
    axis: i32,
    budget: &mut Budget,
) -> Result<Array> {
    let op = "normalize";
    ensure_rank(op, a)?;
    let axis = axis_index(op, axis, a.shape.len())?;
    let (_, n, inner) = split(a, axis);
    for (name, values) in [("mean", mean), ("std", std)] {
        if values.len() != n && values.len() != 1 {
            return Err(invalid(
                op,
                format!(
                    "{name} has {} values; axis {axis} has {n} (give {n} or 1)",
                    values.len()
                ),
            ));
        }
    }
    if let Some(i) = std.iter().position(|s| *s == 0.0 || !s.is_finite()) {
        return Err(invalid(
            op,
            format!("std[{i}] is {}; it must be finite and not 0", std[i]),
        ));
    }
    budget.take_elements(op, a.len() * 2, DataType::Fp32)?;
    let per_index = |values: &[f32]| -> Vec<f32> {
        (0..n)
            .map(|c| {
                if values.len() == 1 {
                    values[0]
                } else {
                    values[c]
                }
            })
            .collect()
    };
    let (mean, std) = (per_index(mean), per_index(std));
    let mut values = a.to_f32();
    if n > 0 && inner == 1 {
        // Channels last (HWC): the per-channel values repeated over a run of pixels, so that
        // the loop below runs over contiguous lanes.
        const PIXELS: usize = 64;
        let run = n * PIXELS;
        let means: Vec<f32> = mean.iter().copied().cycle().take(run).collect();
        let stds: Vec<f32> = std.iter().copied().cycle().take(run).collect();
        let mut chunks = values.chunks_exact_mut(run);
        for chunk in &mut chunks {
            for ((v, m), s) in chunk.iter_mut().zip(&means).zip(&stds) {
                *v = (*v * scale - m) / s;
            }
        }
        for ((v, m), s) in chunks.into_remainder().iter_mut().zip(&means).zip(&stds) {
            *v = (*v * scale - m) / s;
        }
    } else if n > 0 && inner > 0 {
        for (j, block) in values.chunks_exact_mut(inner).enumerate() {
            let (m, s) = (mean[j % n], std[j % n]);
            for v in block {
                *v = (*v * scale - m) / s;
            }
        }
    }
    Ok(Array::from_f32(a.shape.clone(), &values))
}

/// fp32 softmax along `axis`.
pub fn softmax(a: &Array, axis: i32, budget: &mut Budget) -> Result<Array> {
    let op = "softmax";
    ensure_rank(op, a)?;
    let axis = axis_index(op, axis, a.shape.len())?;
    let (outer, n, inner) = split(a, axis);
    budget.take_elements(op, a.len() * 2, DataType::Fp32)?;
    let mut values = a.to_f32();
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * n + k) * inner + i;
            let max = (0..n)
                .map(|k| values[at(k)])
                .fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for k in 0..n {
                let e = (values[at(k)] - max).exp();
                values[at(k)] = e;
                sum += e;
            }
            for k in 0..n {
                values[at(k)] /= sum;
            }
        }
    }
    Ok(Array::from_f32(a.shape.clone(), &values))
}

/// fp32 logistic sigmoid.
pub fn sigmoid(a: &Array, budget: &mut Budget) -> Result<Array> {
    budget.take_elements("sigmoid", a.len() * 2, DataType::Fp32)?;
    let values: Vec<f32> = a
        .to_f32()
        .into_iter()
        .map(|x| 1.0 / (1.0 + (-x).exp()))
        .collect();
    Ok(Array::from_f32(a.shape.clone(), &values))
}

/// int64 index of the largest value along `axis` (the first on ties); the axis is removed.
pub fn argmax(a: &Array, axis: i32, budget: &mut Budget) -> Result<Array> {
    let op = "argmax";
    ensure_rank(op, a)?;
    let axis = axis_index(op, axis, a.shape.len())?;
    let (outer, n, inner) = split(a, axis);
    if n == 0 {
        return Err(invalid(op, format!("axis {axis} is empty")));
    }
    budget.take_elements(op, a.len(), DataType::Fp32)?;
    budget.take_elements(op, outer * inner, DataType::Int64)?;
    let values = a.to_f32();
    let mut indices = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let mut best = 0;
            for k in 1..n {
                if values[(o * n + k) * inner + i] > values[(o * n + best) * inner + i] {
                    best = k;
                }
            }
            indices.push(best as i64);
        }
    }
    let mut shape = a.shape.clone();
    shape.remove(axis);
    Ok(Array::from_i64(shape, &indices))
}

/// The `k` largest values along `axis` and their indices, largest first, lower index on ties.
pub fn top_k(a: &Array, k: u32, axis: i32, budget: &mut Budget) -> Result<(Array, Array)> {
    let op = "top-k";
    ensure_rank(op, a)?;
    let axis = axis_index(op, axis, a.shape.len())?;
    let (outer, n, inner) = split(a, axis);
    let k = k as usize;
    if k == 0 || k > n {
        return Err(invalid(
            op,
            format!("k is {k}; it must be between 1 and {n}, the size of axis {axis}"),
        ));
    }
    budget.take_elements(op, a.len() + n, DataType::Fp32)?;
    budget.take_elements(op, outer * inner * k * 3, DataType::Fp32)?;
    let values = a.to_f32();
    let mut top_values = vec![0f32; outer * k * inner];
    let mut top_indices = vec![0i64; outer * k * inner];
    let mut order: Vec<usize> = Vec::with_capacity(n);
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| values[(o * n + j) * inner + i];
            let better = |x: &usize, y: &usize| at(*y).total_cmp(&at(*x)).then(x.cmp(y));
            order.clear();
            order.extend(0..n);
            if k < n {
                order.select_nth_unstable_by(k - 1, better);
            }
            order[..k].sort_by(better);
            for (r, &j) in order[..k].iter().enumerate() {
                top_values[(o * k + r) * inner + i] = at(j);
                top_indices[(o * k + r) * inner + i] = j as i64;
            }
        }
    }
    let mut shape = a.shape.clone();
    shape[axis] = k;
    Ok((
        Array::from_f32(shape.clone(), &top_values),
        Array::from_i64(shape, &top_indices),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn casts_saturate_and_truncate() {
        let a = Array::from_f32(vec![4], &[-3.7, 2.9, 300.0, f32::NAN]);
        let b = cast(&a, DataType::Uint8, &mut Budget::unlimited()).unwrap();
        assert_eq!(b.data, vec![0, 2, 255, 0]);
        let c = cast(&a, DataType::Int32, &mut Budget::unlimited()).unwrap();
        assert_eq!(c.data[..4], (-3i32).to_le_bytes());
    }

    #[test]
    fn softmax_rows_sum_to_one_and_top_k_orders() {
        let a = Array::from_f32(vec![2, 3], &[1.0, 2.0, 3.0, 5.0, 5.0, 1.0]);
        let s = softmax(&a, -1, &mut Budget::unlimited()).unwrap().to_f32();
        assert!((s[0] + s[1] + s[2] - 1.0).abs() < 1e-6);
        let (v, i) = top_k(&a, 2, 1, &mut Budget::unlimited()).unwrap();
        assert_eq!(v.to_f32(), vec![3.0, 2.0, 5.0, 5.0]);
        assert_eq!(i.data, Array::from_i64(vec![2, 2], &[2, 1, 0, 1]).data);
        let m = argmax(&a, 0, &mut Budget::unlimited()).unwrap();
        assert_eq!(m.data, Array::from_i64(vec![3], &[1, 1, 0]).data);
        assert!(top_k(&a, 4, 1, &mut Budget::unlimited()).is_err());
    }

    #[test]
    fn normalize_per_channel_on_any_axis() {
        let a = Array::from_f32(vec![2, 2], &[255.0, 0.0, 255.0, 0.0]);
        let n = normalize(
            &a,
            1.0 / 255.0,
            &[0.5, 0.0],
            &[0.5, 1.0],
            0,
            &mut Budget::unlimited(),
        )
        .unwrap();
        assert_eq!(n.to_f32(), vec![1.0, -1.0, 1.0, 0.0]);
        assert!(normalize(&a, 1.0, &[0.0; 3], &[1.0], -1, &mut Budget::unlimited()).is_err());
        let mut small = Budget::new(8);
        assert!(normalize(&a, 1.0, &[0.0], &[1.0], 0, &mut small).is_err());
    }
}
