//! Layout operations: reshape, axis permutation, stacking.

use super::{array::count, invalid, Array, Budget};
use crate::error::Result;

/// The same elements under another shape; one dimension may be -1.
pub fn reshape(a: &Array, shape: &[i64], budget: &mut Budget) -> Result<Array> {
    let op = "array.reshape";
    let mut inferred = None;
    let mut dims = Vec::with_capacity(shape.len());
    for (i, &d) in shape.iter().enumerate() {
        match d {
            -1 if inferred.is_none() => {
                inferred = Some(i);
                dims.push(1);
            }
            d if d >= 0 => dims.push(d as usize),
            _ => {
                return Err(invalid(
                    op,
                    format!("dimension {i} is {d}; only one may be -1"),
                ))
            }
        }
    }
    let known = count(op, &dims)?;
    if let Some(i) = inferred {
        if known == 0 || !a.len().is_multiple_of(known) {
            return Err(invalid(
                op,
                format!(
                    "cannot infer dimension {i} of {shape:?} for {} elements",
                    a.len()
                ),
            ));
        }
        dims[i] = a.len() / known;
    }
    if count(op, &dims)? != a.len() {
        return Err(invalid(
            op,
            format!(
                "shape {shape:?} does not hold the {} elements of shape {:?}",
                a.len(),
                a.shape
            ),
        ));
    }
    budget.take(op, a.data.len())?;
    Ok(Array {
        datatype: a.datatype,
        shape: dims,
        data: a.data.clone(),
    })
}

/// Permutes the axes: output axis i is input axis `axes[i]`.
pub fn transpose(a: &Array, axes: &[u32], budget: &mut Budget) -> Result<Array> {
    let op = "transpose";
    let rank = a.shape.len();
    let mut seen = vec![false; rank];
    if axes.len() != rank
        || axes
            .iter()
            .any(|&x| (x as usize) >= rank || std::mem::replace(&mut seen[x as usize], true))
    {
        return Err(invalid(
            op,
            format!(
                "axes {axes:?} are not a permutation of the {rank} axes of shape {:?}",
                a.shape
            ),
        ));
    }
    budget.take(op, a.data.len())?;
    let size = a.datatype.element_size().unwrap_or(1);
    let shape: Vec<usize> = axes.iter().map(|&x| a.shape[x as usize]).collect();
    // Input strides (in elements), reordered to follow the output's axes.
    let mut strides = vec![1usize; rank];
    for i in (0..rank.saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * a.shape[i + 1];
    }
    let strides: Vec<usize> = axes.iter().map(|&x| strides[x as usize]).collect();
    let mut data = vec![0u8; a.data.len()];
    if a.is_empty() {
        return Ok(Array {
            datatype: a.datatype,
            shape,
            data,
        });
    }
    match size {
        1 => gather::<1>(&a.data, &mut data, &shape, &strides),
        2 => gather::<2>(&a.data, &mut data, &shape, &strides),
        4 => gather::<4>(&a.data, &mut data, &shape, &strides),
        _ => gather::<8>(&a.data, &mut data, &shape, &strides),
    }
    Ok(Array {
        datatype: a.datatype,
        shape,
        data,
    })
}

/// Writes `out` in order, reading each element of `N` bytes at its strided place in `src`:
/// the innermost axis is a strided copy, the outer ones an odometer.
fn gather<const N: usize>(src: &[u8], out: &mut [u8], shape: &[usize], strides: &[usize]) {
    let rank = shape.len();
    let inner = shape[rank - 1];
    let step = strides[rank - 1] * N;
    let mut index = vec![0usize; rank - 1];
    for line in out.chunks_exact_mut(inner * N) {
        let base: usize = index.iter().zip(strides).map(|(i, s)| i * s).sum::<usize>() * N;
        for (k, dst) in line.chunks_exact_mut(N).enumerate() {
            let at = base + k * step;
            dst.copy_from_slice(&src[at..at + N]);
        }
        for axis in (0..rank - 1).rev() {
            index[axis] += 1;
            if index[axis] < shape[axis] {
                break;
            }
            index[axis] = 0;
        }
    }
}

/// Joins arrays of one datatype and shape along a new first axis.
pub fn stack(arrays: &[&Array], budget: &mut Budget) -> Result<Array> {
    let op = "stack";
    let Some(first) = arrays.first() else {
        return Err(invalid(op, "no arrays to stack"));
    };
    if let Some((i, other)) = arrays
        .iter()
        .enumerate()
        .find(|(_, a)| a.datatype != first.datatype || a.shape != first.shape)
    {
        return Err(invalid(
            op,
            format!(
                "array {i} is {} {:?} but array 0 is {} {:?}",
                other.datatype, other.shape, first.datatype, first.shape
            ),
        ));
    }
    let bytes = first
        .data
        .len()
        .checked_mul(arrays.len())
        .ok_or_else(|| invalid(op, "the result is too large"))?;
    budget.take(op, bytes)?;
    let mut data = Vec::with_capacity(bytes);
    for a in arrays {
        data.extend_from_slice(&a.data);
    }
    let mut shape = vec![arrays.len()];
    shape.extend_from_slice(&first.shape);
    Ok(Array {
        datatype: first.datatype,
        shape,
        data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hwc_to_chw_and_back() {
        let values: Vec<f32> = (0..2 * 3 * 4).map(|v| v as f32).collect();
        let hwc = Array::from_f32(vec![2, 3, 4], &values);
        let chw = transpose(&hwc, &[2, 0, 1], &mut Budget::unlimited()).unwrap();
        assert_eq!(chw.shape, vec![4, 2, 3]);
        // chw[c][y][x] == hwc[y][x][c]
        let v = chw.to_f32();
        assert_eq!(v[6 + 3 + 2], values[(3 + 2) * 4 + 1]);
        let back = transpose(&chw, &[1, 2, 0], &mut Budget::unlimited()).unwrap();
        assert_eq!(back, hwc);
        assert!(transpose(&hwc, &[0, 0, 1], &mut Budget::unlimited()).is_err());
    }

    #[test]
    fn reshape_infers_one_dimension() {
        let a = Array::from_f32(vec![2, 6], &[0.0; 12]);
        let b = reshape(&a, &[3, -1], &mut Budget::unlimited()).unwrap();
        assert_eq!(b.shape, vec![3, 4]);
        assert!(reshape(&a, &[5, -1], &mut Budget::unlimited()).is_err());
        assert!(reshape(&a, &[-1, -1], &mut Budget::unlimited()).is_err());
    }
}
