//! Text boxes from the detector's probability map, as PP-OCR's DB post-processing finds them
//! (`DBPostProcess` in rapidocr): threshold, 2x2 dilation, one region per 8-connected blob,
//! its minimum-area rectangle, the mean probability inside it, the rectangle grown by
//! `area * unclip_ratio / perimeter` (round joins), scaled back to the image.

/// A point in pixels.
pub type Point = [f64; 2];

/// Detection settings (rapidocr's defaults).
pub struct DbParams {
    pub thresh: f32,
    pub box_thresh: f32,
    pub unclip_ratio: f64,
    pub max_candidates: usize,
}

/// A probability map `width` x `height`, row-major.
pub struct ProbMap<'a> {
    pub width: usize,
    pub height: usize,
    pub values: &'a [f32],
}

/// The boxes (corners clockwise from top-left, in image pixels) of the text regions.
pub fn detect(map: &ProbMap, params: &DbParams, image_w: usize, image_h: usize) -> Vec<[Point; 4]> {
    let (w, h) = (map.width, map.height);
    let above: Vec<bool> = map.values.iter().map(|&p| p > params.thresh).collect();
    // cv2.dilate with a 2x2 kernel (anchor at its centre): a pixel is set when it or its left,
    // upper or upper-left neighbour is.
    let mut mask = vec![false; w * h];
    for y in 0..h {
        for x in 0..w {
            mask[y * w + x] = above[y * w + x]
                || (x > 0 && above[y * w + x - 1])
                || (y > 0 && above[(y - 1) * w + x])
                || (x > 0 && y > 0 && above[(y - 1) * w + x - 1]);
        }
    }
    let mut boxes = Vec::new();
    for region in regions(&mut mask, w, h)
        .into_iter()
        .take(params.max_candidates)
    {
        let Some((corners, short_side)) = mini_box(&region) else {
            continue;
        };
        if short_side < 3.0 {
            continue;
        }
        if params.box_thresh > box_score(map, &corners) {
            continue;
        }
        let grown = unclip(&corners, params.unclip_ratio);
        let Some((corners, short_side)) = mini_box(&grown) else {
            continue;
        };
        if short_side < 5.0 {
            continue;
        }
        // In float32, as numpy computes on the float32 box.
        let scale = |v: f64, from: usize, to: usize| {
            f64::from((v as f32 / from as f32 * to as f32).round_ties_even()).clamp(0.0, to as f64)
        };
        // Whole pixels already (rounded), as rapidocr's int32 boxes.
        let scaled = corners.map(|[x, y]| [scale(x, w, image_w), scale(y, h, image_h)]);
        let ordered = order_clockwise(scaled).map(|[x, y]| {
            [
                x.clamp(0.0, image_w as f64 - 1.0),
                y.clamp(0.0, image_h as f64 - 1.0),
            ]
        });
        let width = distance(ordered[0], ordered[1]) as i64;
        let height = distance(ordered[0], ordered[3]) as i64;
        if width <= 3 || height <= 3 {
            continue;
        }
        boxes.push(ordered);
    }
    sort_reading_order(&mut boxes);
    boxes
}

fn distance(a: Point, b: Point) -> f64 {
    ((a[0] - b[0]).powi(2) + (a[1] - b[1]).powi(2)).sqrt()
}

/// The pixel coordinates of each 8-connected region of `mask` (cleared as it goes).
fn regions(mask: &mut [bool], w: usize, h: usize) -> Vec<Vec<Point>> {
    let mut found = Vec::new();
    let mut stack = Vec::new();
    for start in 0..mask.len() {
        if !mask[start] {
            continue;
        }
        mask[start] = false;
        stack.push(start);
        let mut pixels = Vec::new();
        while let Some(i) = stack.pop() {
            let (x, y) = (i % w, i / w);
            pixels.push([x as f64, y as f64]);
            for dy in -1i64..=1 {
                for dx in -1i64..=1 {
                    let (nx, ny) = (x as i64 + dx, y as i64 + dy);
                    if nx < 0 || ny < 0 || nx >= w as i64 || ny >= h as i64 {
                        continue;
                    }
                    let j = ny as usize * w + nx as usize;
                    if mask[j] {
                        mask[j] = false;
                        stack.push(j);
                    }
                }
            }
        }
        found.push(pixels);
    }
    found
}

/// Convex hull, counter-clockwise (Andrew's monotone chain).
fn hull(points: &[Point]) -> Vec<Point> {
    let mut p = points.to_vec();
    p.sort_by(|a, b| a[0].total_cmp(&b[0]).then(a[1].total_cmp(&b[1])));
    p.dedup();
    if p.len() < 3 {
        return p;
    }
    let cross = |o: Point, a: Point, b: Point| {
        (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])
    };
    let mut lower: Vec<Point> = Vec::new();
    for &q in &p {
        while lower.len() >= 2 && cross(lower[lower.len() - 2], lower[lower.len() - 1], q) <= 0.0 {
            lower.pop();
        }
        lower.push(q);
    }
    let mut upper: Vec<Point> = Vec::new();
    for &q in p.iter().rev() {
        while upper.len() >= 2 && cross(upper[upper.len() - 2], upper[upper.len() - 1], q) <= 0.0 {
            upper.pop();
        }
        upper.push(q);
    }
    lower.pop();
    upper.pop();
    lower.extend(upper);
    lower
}

/// The minimum-area rectangle around `points` (`cv2.minAreaRect` + `boxPoints`), its corners
/// ordered as rapidocr's `get_mini_boxes` orders them, and its shorter side.
fn mini_box(points: &[Point]) -> Option<([Point; 4], f64)> {
    let hull = hull(points);
    if hull.is_empty() {
        return None;
    }
    let mut best: Option<(f64, [Point; 4], f64)> = None;
    let n = hull.len();
    for i in 0..n.max(1) {
        let (a, b) = (hull[i], hull[(i + 1) % n]);
        let len = distance(a, b);
        let (ux, uy) = if len > 0.0 {
            ((b[0] - a[0]) / len, (b[1] - a[1]) / len)
        } else {
            (1.0, 0.0)
        };
        let (mut lo_u, mut hi_u, mut lo_v, mut hi_v) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for p in &hull {
            let u = p[0] * ux + p[1] * uy;
            let v = -p[0] * uy + p[1] * ux;
            lo_u = lo_u.min(u);
            hi_u = hi_u.max(u);
            lo_v = lo_v.min(v);
            hi_v = hi_v.max(v);
        }
        let area = (hi_u - lo_u) * (hi_v - lo_v);
        if best.as_ref().is_none_or(|(b, _, _)| area < *b - 1e-9) {
            let corner = |u: f64, v: f64| [u * ux - v * uy, u * uy + v * ux];
            let corners = [
                corner(lo_u, lo_v),
                corner(hi_u, lo_v),
                corner(hi_u, hi_v),
                corner(lo_u, hi_v),
            ];
            best = Some((area, corners, (hi_u - lo_u).min(hi_v - lo_v)));
        }
    }
    let (_, corners, short) = best?;
    // cv2.boxPoints gives float32 corners.
    let corners = corners.map(|p| p.map(|v| f64::from(v as f32)));
    // get_mini_boxes: sort by x; of the two left points the upper is first and the lower
    // last; of the two right points the upper is second, the lower third.
    let mut p = corners;
    p.sort_by(|a, b| a[0].total_cmp(&b[0]));
    let (i1, i4) = if p[1][1] > p[0][1] { (0, 1) } else { (1, 0) };
    let (i2, i3) = if p[3][1] > p[2][1] { (2, 3) } else { (3, 2) };
    Some(([p[i1], p[i2], p[i3], p[i4]], short))
}

/// Mean probability inside the box (rapidocr's `box_score_fast`: the box's integer polygon
/// filled within its bounding rectangle).
fn box_score(map: &ProbMap, corners: &[Point; 4]) -> f32 {
    let clampi = |v: f64, n: usize| (v as i64).clamp(0, n as i64 - 1);
    let xs = corners.iter().map(|p| p[0]);
    let ys = corners.iter().map(|p| p[1]);
    let xmin = clampi(xs.clone().fold(f64::MAX, f64::min).floor(), map.width);
    let xmax = clampi(xs.fold(f64::MIN, f64::max).ceil(), map.width);
    let ymin = clampi(ys.clone().fold(f64::MAX, f64::min).floor(), map.height);
    let ymax = clampi(ys.fold(f64::MIN, f64::max).ceil(), map.height);
    let poly: Vec<Point> = corners
        .iter()
        .map(|p| {
            [
                ((p[0] - xmin as f64) as i64) as f64,
                ((p[1] - ymin as f64) as i64) as f64,
            ]
        })
        .collect();
    let (mut sum, mut count) = (0f64, 0u64);
    for y in ymin..=ymax {
        for x in xmin..=xmax {
            if inside(&poly, [(x - xmin) as f64, (y - ymin) as f64]) {
                sum += f64::from(map.values[y as usize * map.width + x as usize]);
                count += 1;
            }
        }
    }
    if count == 0 {
        0.0
    } else {
        (sum / count as f64) as f32
    }
}

/// Whether `p` lies inside the convex polygon or on its edge.
fn inside(poly: &[Point], p: Point) -> bool {
    let mut sign = 0i8;
    for i in 0..poly.len() {
        let (a, b) = (poly[i], poly[(i + 1) % poly.len()]);
        let c = (b[0] - a[0]) * (p[1] - a[1]) - (b[1] - a[1]) * (p[0] - a[0]);
        let s = if c > 1e-9 {
            1
        } else if c < -1e-9 {
            -1
        } else {
            0
        };
        if s != 0 {
            if sign != 0 && s != sign {
                return false;
            }
            sign = s;
        }
    }
    true
}

/// The box grown by `area * ratio / perimeter` with round corners, as rapidocr grows it: the
/// distance from the float box (shapely's area and length), the offset of the box truncated
/// to integers (pyclipper's `PyclipperOffset` with `JT_ROUND`, arc tolerance 0.25), whose
/// vertices are rounded to integers. Reproducing Clipper's arc steps and rounding, not just a
/// circle, matters: a vertex a pixel off moves the final box by a pixel, and a crop a pixel
/// narrower can lose or gain a space between words.
fn unclip(corners: &[Point; 4], ratio: f64) -> Vec<Point> {
    let (mut area, mut perimeter) = (0.0, 0.0);
    for i in 0..4 {
        let (a, b) = (corners[i], corners[(i + 1) % 4]);
        area += a[0] * b[1] - b[0] * a[1];
        perimeter += distance(a, b);
    }
    let delta = (area / 2.0).abs() * ratio / perimeter.max(1e-9);
    let mut poly: Vec<Point> = Vec::with_capacity(4);
    for p in corners.map(|[x, y]| [x.trunc(), y.trunc()]) {
        if poly.last() != Some(&p) {
            poly.push(p);
        }
    }
    while poly.len() > 1 && poly.first() == poly.last() {
        poly.pop();
    }
    if poly.len() < 3 {
        return poly;
    }
    clipper_round_offset(&poly, delta)
}

/// Clipper 6's `ClipperOffset` of one closed polygon by `delta` > 0 with round joins (the
/// union Clipper runs afterwards only drops collinear or duplicate vertices, which change no
/// hull).
fn clipper_round_offset(src: &[Point], delta: f64) -> Vec<Point> {
    // Clipper makes the polygon positively oriented (its `Area` >= 0) before offsetting.
    let signed: f64 = (0..src.len())
        .map(|i| {
            let (a, b) = (src[(i + src.len() - 1) % src.len()], src[i]);
            (a[0] + b[0]) * (a[1] - b[1])
        })
        .sum::<f64>()
        * -0.5;
    let mut src = src.to_vec();
    if signed < 0.0 {
        src.reverse();
    }
    // Clipper's Round: half away from zero.
    let round = |v: f64| {
        if v < 0.0 {
            (v - 0.5).trunc()
        } else {
            (v + 0.5).trunc()
        }
    };
    let arc_tolerance = 0.25f64.min(delta * 0.25);
    let mut steps = std::f64::consts::PI / (1.0 - arc_tolerance / delta).acos();
    steps = steps.min(delta * std::f64::consts::PI);
    let (sin, cos) = (std::f64::consts::TAU / steps).sin_cos();
    let steps_per_rad = steps / std::f64::consts::TAU;
    let n = src.len();
    let normal = |a: Point, b: Point| {
        let (dx, dy) = (b[0] - a[0], b[1] - a[1]);
        if dx == 0.0 && dy == 0.0 {
            return [0.0, 0.0];
        }
        let f = 1.0 / (dx * dx + dy * dy).sqrt();
        [dy * f, -dx * f]
    };
    let normals: Vec<Point> = (0..n).map(|j| normal(src[j], src[(j + 1) % n])).collect();
    let mut out = Vec::new();
    let mut k = n - 1;
    for j in 0..n {
        let (nk, nj, p) = (normals[k], normals[j], src[j]);
        let at = |v: Point| [round(p[0] + v[0] * delta), round(p[1] + v[1] * delta)];
        let mut sin_a = nk[0] * nj[1] - nj[0] * nk[1];
        let cos_a = nk[0] * nj[0] + nk[1] * nj[1];
        if (sin_a * delta).abs() < 1.0 && cos_a > 0.0 {
            // Nearly straight on: one vertex.
            out.push(at(nk));
            k = j;
            continue;
        }
        sin_a = sin_a.clamp(-1.0, 1.0);
        if sin_a * delta < 0.0 {
            // A concave corner.
            out.push(at(nk));
            out.push(p);
            out.push(at(nj));
        } else {
            let a = sin_a.atan2(cos_a);
            let count = ((steps_per_rad * a.abs()).round() as i64).max(1);
            let [mut x, mut y] = nk;
            for _ in 0..count {
                out.push(at([x, y]));
                (x, y) = (x * cos - sin * y, x * sin + y * cos);
            }
            out.push(at(nj));
        }
        k = j;
    }
    out
}

/// rapidocr's `order_points_clockwise`: top-left, top-right, bottom-right, bottom-left.
fn order_clockwise(p: [Point; 4]) -> [Point; 4] {
    let mut by_x = p;
    by_x.sort_by(|a, b| a[0].total_cmp(&b[0]));
    let mut left = [by_x[0], by_x[1]];
    let mut right = [by_x[2], by_x[3]];
    left.sort_by(|a, b| a[1].total_cmp(&b[1]));
    right.sort_by(|a, b| a[1].total_cmp(&b[1]));
    [left[0], right[0], right[1], left[1]]
}

/// rapidocr's `sorted_boxes`: top to bottom, and left to right within 10 pixels of height.
fn sort_reading_order(boxes: &mut [[Point; 4]]) {
    boxes.sort_by(|a, b| {
        a[0][1]
            .total_cmp(&b[0][1])
            .then(a[0][0].total_cmp(&b[0][0]))
    });
    for i in 0..boxes.len().saturating_sub(1) {
        for j in (0..=i).rev() {
            if (boxes[j + 1][0][1] - boxes[j][0][1]).abs() < 10.0
                && boxes[j + 1][0][0] < boxes[j][0][0]
            {
                boxes.swap(j, j + 1);
            } else {
                break;
            }
        }
    }
}
