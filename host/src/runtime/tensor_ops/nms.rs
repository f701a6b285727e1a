//! Non-maximum suppression of detection boxes.

use super::{invalid, Array, Budget};
use crate::{error::Result, tensor::DataType};

/// How a box is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoxFormat {
    /// x1, y1, x2, y2.
    Corners,
    /// cx, cy, width, height.
    Center,
}

/// torchvision.ops.nms after dropping boxes below `score_threshold`; int64 kept indices,
/// best first, at most `max_outputs` (0: all).
pub fn nms(
    boxes: &Array,
    scores: &Array,
    format: BoxFormat,
    iou_threshold: f32,
    score_threshold: f32,
    max_outputs: u32,
    budget: &mut Budget,
) -> Result<Array> {
    let op = "nms";
    let n = match boxes.shape.as_slice() {
        &[n, 4] => n,
        other => {
            return Err(invalid(
                op,
                format!("boxes must be [n, 4], got shape {other:?}"),
            ))
        }
    };
    if scores.shape != [n] {
        return Err(invalid(
            op,
            format!(
                "scores must be [{n}] (one per box), got shape {:?}",
                scores.shape
            ),
        ));
    }
    if boxes.datatype != DataType::Fp32 || scores.datatype != DataType::Fp32 {
        return Err(invalid(op, "boxes and scores must be FP32"));
    }
    if !(0.0..=1.0).contains(&iou_threshold) {
        return Err(invalid(
            op,
            format!("iou-threshold {iou_threshold} is not within [0, 1]"),
        ));
    }
    budget.take(op, n * (16 + 8 + 8 + 1))?;
    let corners: Vec<[f32; 4]> = boxes
        .to_f32()
        .chunks_exact(4)
        .map(|b| match format {
            BoxFormat::Corners => [b[0], b[1], b[2], b[3]],
            BoxFormat::Center => [
                b[0] - b[2] / 2.0,
                b[1] - b[3] / 2.0,
                b[0] + b[2] / 2.0,
                b[1] + b[3] / 2.0,
            ],
        })
        .collect();
    let scores = scores.to_f32();
    let area = |b: &[f32; 4]| (b[2] - b[0]).max(0.0) * (b[3] - b[1]).max(0.0);
    let mut order: Vec<usize> = (0..n).filter(|&i| scores[i] >= score_threshold).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let limit = if max_outputs == 0 {
        n
    } else {
        max_outputs as usize
    };
    let mut kept: Vec<usize> = Vec::new();
    for i in order {
        if kept.len() >= limit {
            break;
        }
        let a = &corners[i];
        let suppressed = kept.iter().any(|&j| {
            let b = &corners[j];
            let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
            let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
            let inter = w * h;
            let union = area(a) + area(b) - inter;
            union > 0.0 && inter / union > iou_threshold
        });
        if !suppressed {
            kept.push(i);
        }
    }
    let indices: Vec<i64> = kept.iter().map(|&i| i as i64).collect();
    Ok(Array::from_i64(vec![indices.len()], &indices))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_boxes_keep_the_best() {
        let boxes = Array::from_f32(
            vec![3, 4],
            &[
                0.0, 0.0, 10.0, 10.0, 1.0, 1.0, 11.0, 11.0, 20.0, 20.0, 30.0, 30.0,
            ],
        );
        let scores = Array::from_f32(vec![3], &[0.8, 0.9, 0.7]);
        let kept = nms(
            &boxes,
            &scores,
            BoxFormat::Corners,
            0.5,
            0.0,
            0,
            &mut Budget::unlimited(),
        )
        .unwrap();
        assert_eq!(kept.data, Array::from_i64(vec![2], &[1, 2]).data);
        let kept = nms(
            &boxes,
            &scores,
            BoxFormat::Corners,
            0.5,
            0.75,
            0,
            &mut Budget::unlimited(),
        )
        .unwrap();
        // Box 2 scores below the threshold; box 0 overlaps box 1.
        assert_eq!(kept.data, Array::from_i64(vec![1], &[1]).data);
    }
}
